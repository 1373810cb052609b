"""Run ``sglang.launch_server`` with one field the plugin's guards read renamed, as a pin bump
that renamed it upstream would leave it (issue 36: the start check must refuse, naming it).

``LORA_VERSIONS_RENAMED`` says which one (see RENAMES): an attribute SGLang's request
normalisation sets (checked at plugin load, before anything is spawned), or an attribute of the
live TokenizerManager (checked when the HTTP server is set up, after the scheduler is ready).
"""

import os
import runpy
import sys
from collections.abc import Callable

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager

RENAMED_SUFFIX = "_renamed_upstream"


def rename_after(cls: type, method: str, attribute: str) -> Callable[[], None]:
    """After ``cls.method`` has run, ``attribute`` of the instance is named otherwise."""

    def install() -> None:
        real = getattr(cls, method)

        def renaming(self, *args, **kwargs):
            result = real(self, *args, **kwargs)
            if attribute in self.__dict__:
                self.__dict__[attribute + RENAMED_SUFFIX] = self.__dict__.pop(attribute)
            return result

        setattr(cls, method, renaming)

    return install


RENAMES: dict[str, Callable[[], None]] = {
    **{
        f"GenerateReqInput.{a}": rename_after(GenerateReqInput, "normalize_batch_and_arguments", a)
        for a in ("is_single", "batch_size", "parallel_sample_num")
    },
    "TokenizerManager.rid_to_state": rename_after(TokenizerManager, "__init__", "rid_to_state"),
}

RENAMES[os.environ["LORA_VERSIONS_RENAMED"]]()
sys.argv[0] = "sglang.launch_server"
runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
