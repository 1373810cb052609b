"""What served a reply, as the engine attests it (issue 39): the one wire shape, written by the
engine plugin and read by the trainer side.

The engine's scheduler reads, at every forward step, the LoRA slot each row of the batch ran on
(the slot index the LoRA kernels read, not the request's ``lora_path``) and records one entry per
output token: the name of the adapter in that slot, or :data:`BASE_MODEL` for a row that ran on
the base model. The engine's main process turns those entries into spans on each reply's
``meta_info``, in the shape of SGLang's own ``weight_versions`` (``version``, ``start``, ``end``),
so one parser reads both:

``meta_info["lora_versions"]``
    ``[{"version", "start", "end", "adapter", "epoch", "version_id", "digest"}, ...]``: runs of
    output tokens served by one adapter, ``start``/``end`` token offsets (end exclusive) into the
    output tokens the reply covers (the whole output so far, or, with incremental streaming, the
    chunk, as ``output_token_logprobs`` does). ``adapter`` is ``managed`` (a managed version:
    ``epoch``, ``version_id`` and the full ``digest`` filled in), ``unmanaged`` (a stock adapter,
    ``version`` its name), ``base`` (no adapter, ``version`` None) or ``unattested`` (tokens the
    engine could not attribute: ``version`` None; never counted as a match).
``meta_info["lora_version"]``
    the last span's ``version`` (as ``weight_version`` is for ``weight_versions``).

:func:`served_version_problem` is the check the session layer makes against a binding on every
reply: every token of it served by exactly that managed version, or a typed mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from lora_contract.names import parse_lora_name

# The scheduler's per-token entries, carried by SGLang's per-request ``customized_info`` (a
# token-level key: SGLang slices it with the output tokens it sends, and the tokenizer manager
# accumulates it per request). The main process replaces it by the spans below.
SERVED_TOKENS_KEY = "lora_versions_served_by"
BASE_MODEL = ""  # the entry of a row that ran on the base model (no adapter slot)

SPANS_KEY = "lora_versions"
LAST_KEY = "lora_version"

AdapterKind = Literal["managed", "unmanaged", "base", "unattested"]


@dataclass(frozen=True)
class ServedSpan:
    version: str | None
    start: int
    end: int
    adapter: AdapterKind
    epoch: str | None = None
    version_id: str | None = None
    digest: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


def _span_of(entry: Any, start: int, end: int, digest_of: Callable[[str], str | None]) -> ServedSpan:
    if entry == BASE_MODEL:
        return ServedSpan(None, start, end, "base")
    if not isinstance(entry, str):
        return ServedSpan(None, start, end, "unattested")
    parsed = parse_lora_name(entry)
    if parsed is None:
        return ServedSpan(entry, start, end, "unmanaged")
    return ServedSpan(entry, start, end, "managed", parsed.epoch, parsed.version_id, digest_of(entry))


def served_spans(entries: Sequence[Any], digest_of: Callable[[str], str | None]) -> list[ServedSpan]:
    """Runs of equal per-token entries (engine side); ``digest_of`` names a managed version's
    full digest (None when the engine no longer knows it)."""
    spans: list[ServedSpan] = []
    start = 0
    for i in range(1, len(entries) + 1):
        if i == len(entries) or entries[i] != entries[start]:
            spans.append(_span_of(entries[start], start, i, digest_of))
            start = i
    return spans


def attach_served_versions(meta_info: dict[str, Any], digest_of: Callable[[str], str | None]) -> None:
    """Replace the scheduler's per-token entries in ``meta_info`` by the spans (engine side). A
    reply without entries (no output token yet) gets an empty list."""
    entries = meta_info.pop(SERVED_TOKENS_KEY, None) or ()
    spans = served_spans(entries, digest_of)
    meta_info[SPANS_KEY] = [span.to_wire() for span in spans]
    meta_info[LAST_KEY] = spans[-1].version if spans else None


def read_served_spans(meta_info: Any) -> list[ServedSpan] | None:
    """The spans of a reply's ``meta_info`` (trainer side); None when it carries none (an engine
    without the plugin, a reply that is not a generation, no ``meta_info`` at all)."""
    raw = meta_info.get(SPANS_KEY) if isinstance(meta_info, Mapping) else None
    if not isinstance(raw, list):
        return None
    spans = []
    for item in raw:
        if not isinstance(item, Mapping):
            return None
        try:
            spans.append(ServedSpan(**{k: item.get(k) for k in ServedSpan.__dataclass_fields__}))
        except TypeError:
            return None
    return spans


def served_version_problem(
    meta_info: Mapping[str, Any] | None, lora_name: str, digest: str, output_tokens: int | None = None
) -> str | None:
    """Why this reply's tokens were not all served by the managed version ``lora_name`` with
    ``digest``; None when they were. A reply with no attestation at all is a problem too: the
    check never passes on what is missing. ``output_tokens``: the tokens the reply covers, when
    known (the spans must cover exactly them)."""
    if not isinstance(meta_info, Mapping):
        return "the reply carries no meta_info"
    return spans_problem(read_served_spans(meta_info), lora_name, digest, output_tokens)


def spans_problem(
    spans: Sequence[ServedSpan] | None, lora_name: str, digest: str, output_tokens: int | None = None
) -> str | None:
    """:func:`served_version_problem` for spans already read (None: the reply carried none)."""
    if spans is None:
        return f"the reply carries no {SPANS_KEY!r} (is the engine's plugin on?)"
    covered = sum(max(0, s.end - s.start) for s in spans)
    if output_tokens is not None and covered != output_tokens:
        return f"{SPANS_KEY} covers {covered} tokens, the reply has {output_tokens}"
    wrong = [s for s in spans if s.adapter != "managed" or s.version != lora_name or s.digest != digest]
    if wrong:
        return "tokens served by another version than the binding: " + ", ".join(describe(s) for s in wrong)
    return None


def describe(span: ServedSpan) -> str:
    what = span.version if span.adapter in ("managed", "unmanaged") else span.adapter
    if span.adapter == "managed":
        what = f"{what} (digest {str(span.digest)[:12]}…)" if span.digest else f"{what} (digest unknown)"
    return f"tokens [{span.start}, {span.end}) by {what}"


def token_versions(meta_info: Mapping[str, Any]) -> list[str | None] | None:
    """One entry per output token the reply covers: the version that served it (None: base model
    or unattested); None when the reply carries no spans."""
    spans = read_served_spans(meta_info)
    if spans is None:
        return None
    return [s.version for s in spans for _ in range(max(0, s.end - s.start))]


def versions_of(spans: Iterable[ServedSpan]) -> tuple[str | None, ...]:
    """The distinct versions in order of first appearance (None for base or unattested)."""
    return tuple(dict.fromkeys(span.version for span in spans))
