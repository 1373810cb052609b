"""Development tools, shipped beside the demo and never imported by the plugin, the contract or
the trainer side: the CPU engine launcher and its shims, the fixture generator, device profiles,
the engine-log readers, the HF+PEFT reference, the control-plane fuzzer, fault injection around
the real engine client, the gateway process and the test teardown."""
