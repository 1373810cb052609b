"""The contract between the engine plugin (``sglang_ext``) and the trainer side (``relax_glue``):
the only door between the two. Error codes, version names and identity, the manifest, the
transport encoding, the HTTP messages and their wire models, the base-model fingerprint and the
collective group's rules.

Both sides import this package; it imports neither of them, nor SGLang (torch and safetensors
only inside the functions that hash or decode tensors), so a trainer installs and runs it
without an engine (``tests/contract_tests/test_contract_imports.py``).
"""
