"""The main job: two real CPU SGLang engines with the plugin, and what they serve.

Until the staged publication lands, the demo loads the fixture adapters A and B through SGLang's
stock ``/load_lora_adapter`` and shows that base, A and B give different greedy tokens, the same
on E0 and E1, equal to an independent HF transformers + PEFT (fp32) reference.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

PROMPT_IDS = [302, 356, 417, 494, 439]  # "The quick brown" in the fixture tokenizer
MAX_NEW_TOKENS = 12


def _generate(client: httpx.Client, url: str, lora: str | None) -> tuple[list[int], str, float]:
    body: dict = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
    }
    if lora is not None:
        body["lora_path"] = lora
    t0 = time.perf_counter()
    r = client.post(f"{url}/generate", json=body)
    r.raise_for_status()
    out = r.json()
    return out["output_ids"], out["text"], (time.perf_counter() - t0) * 1000


def run_demo(out_dir: Path) -> int:
    from sglang_ext.devtools import reference
    from sglang_ext.devtools.fixtures import ensure_fixtures
    from sglang_ext.devtools.launcher import EngineSpec, running_engines

    out_dir.mkdir(parents=True, exist_ok=True)
    print("[demo] preparing fixtures (tiny Qwen3 + BPE tokenizer + adapters A/B/C; cached)")
    fx = ensure_fixtures()
    specs = [EngineSpec(name=n, model_path=fx.model_dir, log_path=out_dir / f"{n}.log") for n in ("E0", "E1")]
    print(f"[demo] starting E0 and E1 in parallel (CPU dev mode, plugin on; logs in {out_dir})")
    t0 = time.monotonic()
    rows = []
    with running_engines(specs) as engines, httpx.Client(timeout=120) as client:
        print(f"[demo] both engines healthy after {time.monotonic() - t0:.1f}s")
        for e in engines:
            status = client.get(f"{e.url}/lora_versions").json()
            print(
                f"[demo] {e.name} at {e.url}: incarnation {status['incarnation']}, "
                f"managed versions {len(status['versions'])}"
            )
            for name in ("A", "B"):
                r = client.post(
                    f"{e.url}/load_lora_adapter",
                    json={"lora_name": f"fixture-{name}", "lora_path": str(fx.adapter_dir(name))},
                )
                r.raise_for_status()
        for name in (None, "A", "B"):
            expected = reference.greedy_tokens(
                fx.model_dir, None if name is None else fx.adapter_dir(name), PROMPT_IDS, MAX_NEW_TOKENS
            )
            for e in engines:
                tokens, text, ms = _generate(client, e.url, None if name is None else f"fixture-{name}")
                rows.append(
                    {
                        "engine": e.name,
                        "adapter": name or "base",
                        "tokens": tokens,
                        "text": text,
                        "latency_ms": round(ms, 1),
                        "equals_reference": tokens == expected,
                    }
                )
    _print_table(rows)
    (out_dir / "demo.json").write_text(json.dumps(rows, indent=2))
    distinct = len({tuple(r["tokens"]) for r in rows})
    ok = all(r["equals_reference"] for r in rows) and distinct == 3
    print(
        f"[demo] {distinct} distinct outputs for base/A/B; all equal the HF+PEFT reference: "
        f"{all(r['equals_reference'] for r in rows)}; engines stopped; results in {out_dir / 'demo.json'}"
    )
    return 0 if ok else 1


def _print_table(rows: list[dict]) -> None:
    header = f"{'engine':<7}{'adapter':<9}{'greedy tokens (12)':<58}{'ms':>7}  ref"
    print(header)
    print("-" * len(header))
    for r in rows:
        toks = " ".join(str(t) for t in r["tokens"])
        print(
            f"{r['engine']:<7}{r['adapter']:<9}{toks:<58}{r['latency_ms']:>7}  "
            f"{'==' if r['equals_reference'] else '!='}"
        )
