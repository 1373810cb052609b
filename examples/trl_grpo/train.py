"""One training process of the TRL example: ``GRPOTrainer`` with the integration's callback and
rollout function, against engines and a gateway that already run. Run alone (one process) or
under ``accelerate launch`` (every rank runs this; rank 0 publishes). Writes this rank's report
(``rank{r}.json``: ``GRPOVersions.report()`` plus the probes) to the spec's folder.

``python -m examples.trl_grpo.train SPEC.json`` (what ``run.py`` and the engine tests launch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    engines: dict[str, str]  # engine id -> URL (control calls)
    gateway_url: str  # sessions generate through smg
    admin_key: str | None
    model_dir: str
    out_dir: str
    epoch: str
    steps: int = 3  # optimizer steps
    prompts_per_step: int = 1  # per process
    group_size: int = 4  # completions per prompt (TRL's num_generations)
    max_new_tokens: int = 4  # per assistant turn (ignore_eos: exactly this many)
    lr: float = 3e-2
    seed: int = 0
    background: bool = False  # publish while the next step's rollouts run
    max_failures: int = 0
    capacity: int = 2
    # A fault injected into the real engine client the publisher uses: the first bucket of
    # version ``fail_version`` reaches ``fail_engine`` corrupted, which that engine refuses
    # (CHECKSUM_MISMATCH): the publication fails cleanly on one engine.
    fail_version: str | None = None
    fail_engine: str | None = None
    # Ranks on several Ray nodes: the cluster every rank joins for the registry actor (its address
    # and token, given to each rank); None: rank 0 starts a local Ray of the run's own.
    ray_address: str | None = None
    ray_auth_token: str | None = None

    @classmethod
    def load(cls, path: Path) -> TrainSpec:
        return cls(**json.loads(path.read_text()))

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2))


def fault_wrapper(spec: TrainSpec) -> Any:
    """``GRPOVersions.connect``'s ``wrap_publisher_client`` test seam for the spec's fault (None:
    no fault)."""
    if spec.fail_version is None:
        return None
    from lora_versions_dev.fault_injection import FaultInjectingClient

    class CorruptOneVersion(FaultInjectingClient):
        """Arms the real wrapper's corrupt-payload fault for the next bucket call when it carries
        the target version's first bucket; every other call passes through untouched."""

        async def receive_bucket(self, meta: Any, payload: bytes) -> Any:
            if meta.index == 0 and f"-{spec.fail_version}-" in meta.lora_name and not self.injected:
                self.corrupt_bucket(self.calls["receive_bucket"] + 1)
            return await super().receive_bucket(meta, payload)

    return lambda client: CorruptOneVersion(client) if client.engine_id == spec.fail_engine else client


def train_process(spec: TrainSpec) -> dict[str, Any]:
    """Train ``spec.steps`` optimizer steps; return (and write) this rank's report."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    # One intra-op thread: the engines share these cores (the showcase measured 3.6 s per update
    # with one thread per core while the engines decoded beside it, 0.2 s with one).
    torch.set_num_threads(1)
    from trl import GRPOTrainer

    from examples.trl_grpo.task import (
        RewardProbe,
        RolloutProbe,
        ToolTurn,
        digit_reward,
        grpo_config,
        lora_config,
        train_dataset,
    )
    from relax_glue.trl import GRPOVersions, PublicationFailed, VersionsConfig

    out = Path(spec.out_dir)
    per_device = spec.prompts_per_step * spec.group_size
    args = grpo_config(
        out / "trainer",
        per_device_train_batch_size=per_device,
        num_generations=spec.group_size,
        max_steps=spec.steps,
        learning_rate=spec.lr,
        seed=spec.seed,
        ddp_timeout=300,  # a rank that died fails the others' next collective within this
    )
    config = VersionsConfig(
        capacity=spec.capacity,
        background=spec.background,
        max_failures=spec.max_failures,
        ray_address=spec.ray_address,
        ray_auth_token=spec.ray_auth_token,
    )
    versions = GRPOVersions.connect(
        spec.engines,
        gateway_url=spec.gateway_url,
        admin_key=spec.admin_key,
        epoch=spec.epoch,
        config=config,
        wrap_publisher_client=fault_wrapper(spec),
    )
    error = None
    t0 = time.monotonic()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        reward = RewardProbe(digit_reward(tokenizer))
        rollout = RolloutProbe(
            versions.rollout_func(
                env_turn=ToolTurn(tokenizer), max_new_tokens=spec.max_new_tokens, ignore_eos=True
            )
        )
        trainer = GRPOTrainer(
            model=spec.model_dir,
            reward_funcs=[reward],
            args=args,
            train_dataset=train_dataset(repeat=max(1, spec.steps * spec.prompts_per_step * 2)),
            peft_config=lora_config(),
            processing_class=tokenizer,
            rollout_func=rollout,
            callbacks=[versions.callback()],
        )
        try:
            trainer.train()
        except PublicationFailed as exc:  # every rank raises it at the same step
            error = f"PublicationFailed: {exc}"
        report = {
            **versions.report(),
            "reward_calls": [dataclasses.asdict(c) for c in reward.calls],
            "rollout_calls": [dataclasses.asdict(c) for c in rollout.calls],
            "log_history": trainer.state.log_history,
            "error": error,
            "train_s": round(time.monotonic() - t0, 2),
        }
    finally:
        versions.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def launch_command(spec_path: Path, processes: int, port: int) -> list[str]:
    """This module as one process, or under ``accelerate launch`` as ``processes`` ranks
    (``--multi_gpu`` is accelerate's torchrun launcher; ``use_cpu=True`` makes it gloo on CPU)."""
    entry = ["-m", "examples.trl_grpo.train", str(spec_path)]
    if processes == 1:
        return [sys.executable, *entry]
    accelerate = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes)]
    flags = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [sys.executable, *accelerate, *flags, "--main_process_port", str(port), *entry]


def launch(spec: TrainSpec, processes: int, timeout_s: float) -> tuple[int, list[dict[str, Any]]]:
    """Run the training processes to the end (bounded by ``timeout_s``: then their whole process
    group is stopped) and return the exit code and every rank's report. Output goes to
    ``train.log`` in the spec's folder."""
    import socket
    import subprocess

    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec.dump(out / "spec.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    env.update(OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    with (out / "train.log").open("w") as log:
        proc = subprocess.Popen(
            launch_command(out / "spec.json", processes, port),
            cwd=repo,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group: a timeout stops every rank and its children
        )
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = -1
        finally:  # a timeout, Ctrl-C or SIGTERM here: no rank is left running
            if proc.poll() is None:
                _stop_group(proc)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return code, reports


def _stop_group(proc: Any) -> None:
    import signal
    import subprocess

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str]) -> int:
    report = train_process(TrainSpec.load(Path(argv[0])))
    return 0 if report["error"] is None else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
