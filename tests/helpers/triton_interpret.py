"""Run afd's Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
set before anything imports triton: a child process runs this module). Its numpy bridge reads
a loop bound held as a one-element array as an index, which NumPy 2 refuses: patched here to
read the element. Prints one line per case (tests/helpers/attention_cases.py): its name and the
relative error against the torch path in float32."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime import interpreter  # noqa: E402

_patch = interpreter._patch_lang_tensor


def _index_from_one_element(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _index_from_one_element

from tests.helpers.attention_cases import errors  # noqa: E402

if __name__ == "__main__":
    for case, err in errors(int(sys.argv[1]) if len(sys.argv) > 1 else 0).items():
        print(f"{case} {err:.3e}", flush=True)
