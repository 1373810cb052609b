"""SGLang plugin for immutable, versioned LoRA publication.

Importing this package is cheap and imports nothing from SGLang: the trainer side
(``relax_glue``) shares ``lora_contract.errors`` and ``lora_contract.protocol`` without an engine.
The SGLang entry point is ``sglang_ext.plugin:register``.
"""

PINNED_SGLANG_VERSION = "0.5.23"
