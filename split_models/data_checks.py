"""What data a model can take: samples of its input shape and dtype, labels it has outputs
for, token ids in its range; and the unit axis a sample may gain or lose to fit."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from split_models.config import ModelConfig
    from split_models.data import Dataset
    from split_models.options import ModelOptions

__all__ = ["input_problem", "model_data_problem", "scale_warning", "shaped_for"]


def model_data_problem(
    data: Dataset, model: ModelConfig, name: str = "data", device: bool = False
) -> str | None:
    """Why ``data`` (the config's key ``name``) cannot feed ``model``, starting with the key
    to fix; None when it can. Checked before anything is planned or trained. ``device``: the
    data is a device's own (an edge's ``--data``), which is what to fix, not the run's
    config."""
    if problem := input_problem(data, model.options):
        return f"{name}: {problem}"
    if problem := _shape_problem(data, tuple(model.input_shape), name, device):
        return problem
    if problem := _dtype_problem(data, model, name):
        return problem
    if problem := _label_shape_problem(data, model, name):
        return problem
    if data.classes is not None and len(data.classes) < model.num_classes:
        shown = ", ".join(data.classes[:5]) + (", ..." if len(data.classes) > 5 else "")
        return (
            f"{name}: its folder has {len(data.classes)} class folders ({shown}) for a model "
            f"of {model.num_classes} classes; labels follow the sorted folder names, so a "
            "missing class would shift those after it: add the missing class folders (empty "
            f"ones will do) or name the folders by label, 0 to {model.num_classes - 1}"
        )
    top = int(data.y.max())
    if top >= model.num_classes:
        return (
            f"num_classes: the {name} has labels up to {top}, the model {model.num_classes} "
            f"outputs; set num_classes to {top + 1} or more"
        )
    return None


def shaped_for(data: Dataset, input_shape: tuple[int, ...]) -> Dataset:
    """``data`` with a unit axis after the batch added or dropped where that gives samples of
    ``input_shape``: [N, L] or [N, T, F] arrays read as [N, 1, ...] (the channel a 3-D array
    gets, as greyscale images) feed a model of ``[L]`` or ``[T, F]``, and 2-D samples one of
    ``[1, H, W]``; else ``data`` as it is."""
    have = data.input_shape
    if have == input_shape:
        return data
    if have == (1, *input_shape):
        return replace(data, x=data.x[:, 0])
    if (1, *have) == input_shape:
        return replace(data, x=data.x[:, None])
    return data


def _shape_problem(data: Dataset, want: tuple[int, ...], name: str, device: bool) -> str | None:
    have = data.input_shape
    if have == want:
        return None
    fix = f"set input_shape: {list(have)} (--input-shape {','.join(map(str, have))})"
    if device:  # the run's config is the coordinator's: this device's data must match it
        fix = f"give this device samples of shape {list(want)}, as the run's model takes"
    if len(have) == 3 and have[-1] in (1, 3, 4) and (have[-1], *have[:2]) == want:
        fix = "the samples are channels-last: transpose x to [N, C, H, W]"
    return (
        f"input_shape: the {name} has samples of shape {list(have)}, the config says "
        f"{list(want)}; {fix}"
    )


def _dtype_problem(data: Dataset, model: ModelConfig, name: str) -> str | None:
    """Integer features (read as token ids) for a model of float inputs, or the reverse."""
    wants_ids = model.options.input_dtype.startswith("int")
    if data.x.dtype.kind in "iu" and not wants_ids:
        return (
            f"input_dtype: the {name} holds integers, read as token ids, "
            f"but the model takes {model.options.input_dtype}: store images as uint8 (scaled "
            "to [0, 1]) or float32, or set input_dtype: int64 for token ids"
        )
    if data.x.dtype.kind == "f" and wants_ids:
        return (
            f"input_dtype: the model takes token ids ({model.options.input_dtype}) but the "
            f"{name} holds {data.x.dtype} values; store the ids as an integer array"
        )
    return None


def _label_shape_problem(data: Dataset, model: ModelConfig, name: str) -> str | None:
    """Labels of another shape than the model's task takes: one a sample for classification,
    one a position (the samples' shape) for a language model."""
    got = list(data.y.shape[1:])
    if model.task == "language-model":
        want = list(data.input_shape)
        if got != want:
            return (
                f"task: a language model takes a label for every position (labels of shape "
                f"[N, {', '.join(map(str, want))}]); the {name} has labels of shape "
                f"{[len(data), *got]}"
            )
        return None
    if got:
        return (
            f"task: a classification model takes one label a sample (labels of shape [N]); "
            f"the {name} has labels of shape {[len(data), *got]}: flatten them, or set "
            "task: language-model for a label at every position"
        )
    return None


def input_problem(data: Dataset, options: ModelOptions) -> str | None:
    """Why ``data`` cannot feed a model taking ``options``' inputs (None: it can): it holds
    no samples, or token ids outside the model's ``input_range`` (an embedding would fail
    on them mid-round)."""
    if not len(data):
        return "it holds no samples"
    if options.input_range is not None:
        low, high = options.input_range
        bottom, top = data.x.min(), data.x.max()
        if bottom < low or top >= high:
            return (
                f"its token ids span [{bottom}, {top}], outside the model's input_range "
                f"[{low}, {high})"
            )
    return None


_LARGE_FEATURE = 100.0  # float features beyond this are most likely unscaled pixel values


def scale_warning(data: Dataset, name: str = "data") -> str | None:
    """A word for float features far from the usual scale (pixels kept at 0-255): taken as
    they are, they make the first steps huge and a run can end at chance blaming its
    learning rate. uint8 images are scaled to [0, 1] when loaded; float arrays are not."""
    if data.x.dtype.kind != "f" or not len(data):
        return None
    rows = max(1, (64 << 20) // max(1, data.x[:1].nbytes))  # 64 MB at a time: x is not copied
    top = max(
        float(np.nanmax(np.abs(data.x[start : start + rows])))
        for start in range(0, len(data.x), rows)
    )
    if not top > _LARGE_FEATURE:
        return None
    return (
        f"{name}: float features reach {top:.4g}, taken as they are (uint8 images are scaled "
        "to [0, 1], float arrays are not): scale them if they are pixel values, or training "
        "may diverge"
    )
