"""The process that runs the README quickstart and dies mid-episode, for the quickstart's
restart test: it publishes ``step1`` (the epoch's first version), starts an episode whose first
turn binds it, prints ``BOUND <lora_path>`` and waits in its "tool call" (its lease heartbeat
running) until the test SIGKILLs it. argv: model dir, adapter dir, prompt ids (comma separated)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


async def main(model_dir: Path, adapter_dir: Path, prompt: list[int]) -> None:
    from _quickstart import peft_model, run_quickstart

    ns = run_quickstart()
    published = await ns["after_training_step"](peft_model(model_dir, adapter_dir), 1)
    assert published.published, published
    session = await ns["sessions"].open("episode")
    params = {"temperature": 1.0, "max_new_tokens": 4}
    await session.generate({"input_ids": prompt, "sampling_params": params})
    print("BOUND", session.lora_path, flush=True)
    await asyncio.sleep(3600)  # a long tool call; the test kills the process here


if __name__ == "__main__":
    import relax_glue.sessions  # noqa: F401  (the installed packages first: see _group_trainer.py)

    sys.path.insert(0, str(Path(__file__).parent))
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]))
