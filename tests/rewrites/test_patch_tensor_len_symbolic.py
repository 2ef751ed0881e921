"""`patch/tensor-len-symbolic` names its modules by hand: they must be exactly the modeling modules of the installed
transformers that take a batch as `len(source_flatten)`."""

from __future__ import annotations

from pathlib import Path

import transformers

from hfexport.rewrites.rules.patch.tensor_len_symbolic import _MODULES


def test_the_targets_are_the_modules_with_the_len_of_a_tensor_batch() -> None:
    models = Path(transformers.__file__).parent / "models"
    found = {
        path.parent.name
        for path in models.glob("*/modeling_*.py")
        if path.name == f"modeling_{path.parent.name}.py" and "len(source_flatten)" in path.read_text()
    }
    assert found == set(_MODULES)
