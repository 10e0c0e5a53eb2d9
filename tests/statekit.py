"""State comparisons and CLI reads shared by the resume tests (the continuation suite, the Hugging Face
integration): what "resumed exactly" means, checked one way everywhere."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import numpy as np
import torch

from ckptstore.cli import main


def resume_info(url: str) -> tuple[int, dict[str, Any]]:
    """``ckptstore resume-info URL --json``, in-process: (exit code, document)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["resume-info", url, "--json"])
    return code, json.loads(buf.getvalue())


def assert_bitwise(a: Any, b: Any, where: str = "state") -> None:
    """Same structure, same types, same bits: tensors by dtype, shape and torch.equal; numpy arrays by
    dtype and array_equal; floats by their bits; everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {list(b) if isinstance(b, dict) else b}"
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {type(a).__name__}[{len(a)}] vs {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert isinstance(b, float) and (a == b or math.isnan(a) and math.isnan(b)) and \
            math.copysign(1, a) == math.copysign(1, b), f"{where}: {a!r} vs {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"
