"""The admin API key every shared test engine is started with (one definition for all tests)."""

ADMIN_KEY = "lora-versions-test-admin-key"
