"""Runnable demonstrations on local CPU engines (not part of the library: ``relax_glue`` is the
trainer side, ``sglang_ext`` the plugin). ``lora-versions-dev demo`` runs :mod:`.lifecycle`."""
