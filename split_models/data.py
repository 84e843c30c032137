"""Datasets as numpy arrays and their partitions across clients.

Specs: ``npz:PATH`` (arrays ``x`` and ``y``; uint8 images are scaled to [0, 1] and given a
channel axis, other integer arrays are token ids and stay int64), ``digits`` (scikit-learn's
bundled 8x8 digits, if scikit-learn is installed), ``folder:PATH`` (one sub-folder per class of
image files, if Pillow is installed) and ``torchvision:NAME:ROOT`` (a torchvision dataset
already on disk, if torchvision is installed). Nothing is downloaded. From Python, any
``torch.utils.data.Dataset`` of ``(input, label)`` pairs or numpy arrays work too
(:func:`from_torch`, :func:`from_arrays`). Partitions: IID, Dirichlet(alpha) label skew, or
label shards.
"""

from __future__ import annotations

import importlib
import inspect
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from split_models.data_checks import input_problem, model_data_problem, scale_warning, shaped_for
from split_models.errors import ConfigError

__all__ = [
    "PARTITIONS",
    "Dataset",
    "batch_count",
    "batch_slices",
    "from_arrays",
    "from_torch",
    "input_problem",
    "load_dataset",
    "model_data_problem",
    "partition",
    "resolve_spec",
    "scale_warning",
    "shaped_for",
    "shuffle_rng",
    "trained_examples",
]

PARTITIONS = ("iid", "dirichlet", "shards")
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif"}


@dataclass(frozen=True)
class Dataset:
    """``x``: float32 [N, ...] features (or int64 token ids), ``y``: int64 [N] labels in
    ``[0, num_classes)``."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    # an image folder's class folder names, label i the i-th (None: labels as given)
    classes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ConfigError(f"data: {len(self.x)} samples but {len(self.y)} labels")
        if len(self.y) and self.y.min() < 0:
            raise ConfigError(
                f"data: labels must be class indices from 0, found {int(self.y.min())}.."
                f"{int(self.y.max())}"
            )
        if len(self.y) and self.y.max() >= self.num_classes:
            raise ConfigError(
                f"data: labels must be in [0, {self.num_classes}), found "
                f"{int(self.y.min())}..{int(self.y.max())}"
            )

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, indices: np.ndarray) -> Dataset:
        return Dataset(self.x[indices], self.y[indices], self.num_classes, self.classes)

    def split(self, test_fraction: float, seed: int = 0) -> tuple[Dataset, Dataset]:
        """A shuffled (train, test) split."""
        if not 0 < test_fraction < 1:
            raise ConfigError(f"test_fraction: must be in (0, 1), got {test_fraction}")
        order = np.random.default_rng(seed).permutation(len(self))
        cut = len(self) - _held_out(len(self), test_fraction)
        return self.subset(order[:cut]), self.subset(order[cut:])


def trained_examples(examples: int, held_out: float) -> int:
    """Of ``examples``, how many an edge trains on when it holds out the share ``held_out``
    for federated evaluation (the rule of its :meth:`Dataset.split`; none held out when the
    share is not in (0, 1) or it has fewer than 2 examples)."""
    if not 0 < held_out < 1 or examples < 2:
        return examples
    return examples - _held_out(examples, held_out)


def shuffle_rng(seed: int, round_number: int, attempt: int = 1) -> np.random.Generator:
    """The generator of a round's batch order: the first try of a round shuffles as every
    earlier version did (``seed + round_number``); a retry draws another order, so a try
    that failed for its order (one unlucky batch sequence) is not repeated step for step."""
    if attempt <= 1:
        return np.random.default_rng(seed + round_number)
    return np.random.default_rng([seed, round_number, attempt])


def batch_slices(order: np.ndarray, size: int) -> list[np.ndarray]:
    """``order`` in consecutive batches of ``size``; a last batch of one example joins the one
    before it (BatchNorm cannot train on a batch of one: a client holding 33 examples at
    batch 32 failed every round)."""
    starts = list(range(0, len(order), size))
    if not starts:
        return []
    if size > 1 and len(starts) > 1 and len(order) - starts[-1] == 1:
        starts.pop()
    return [order[a:b] for a, b in zip(starts, [*starts[1:], len(order)], strict=True)]


def batch_count(examples: int, size: int) -> int:
    """How many batches :func:`batch_slices` makes of ``examples``."""
    count = -(-examples // size)
    return count - 1 if size > 1 and count > 1 and examples % size == 1 else count


def _held_out(examples: int, share: float) -> int:
    """How many of ``examples`` a share in (0, 1) holds out: at least one."""
    return max(1, round(examples * share))


def _images(x: np.ndarray) -> np.ndarray:
    if np.issubdtype(x.dtype, np.integer) and x.dtype != np.uint8:
        return x.astype(np.int64)  # token ids
    values = x.astype(np.float32)
    if x.dtype == np.uint8:
        values /= 255.0
    if values.ndim == 3:  # [N, H, W] grayscale
        values = values[:, None, :, :]
    return values


def _from_arrays(x: np.ndarray, y: np.ndarray, where: str) -> Dataset:
    if x.ndim < 2 or y.ndim not in (1, 2) or len(y) != len(x):
        raise ConfigError(
            f"{where}: expected x [N, ...] and y [N] (or [N, length]: a token per position), "
            f"got {x.shape} and {y.shape}"
        )
    y = _class_indices(y, where)
    features = _images(x)
    if features.dtype.kind == "f" and not np.all(np.isfinite(features)):
        raise ConfigError(f"{where}: x contains NaN or infinity")
    labels = y.astype(np.int64)
    return Dataset(features, labels, int(labels.max()) + 1 if len(labels) else 0)


def _class_indices(y: np.ndarray, where: str) -> np.ndarray:
    """``y`` as integers: whole numbers stored as floats are taken as they are; strings and
    fractions are refused, naming the fix."""
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        return y.astype(np.int64)  # False, True: classes 0 and 1
    if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
        return y.astype(np.int64)  # 0.0, 1.0, ...: a table's labels read as floats
    if y.dtype.kind in "USO":
        names = np.unique(y.astype(str))
        shown = ", ".join(repr(str(n)) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        raise ConfigError(
            f"{where}: labels must be class indices (integers from 0), got {len(names)} "
            f"named classes ({shown}): map them first, the same way on every device, e.g. "
            "y = np.searchsorted(classes, y) with one sorted list of the class names"
        )
    raise ConfigError(
        f"{where}: labels must be class indices (integers from 0), got {y.dtype} values that "
        "are not whole numbers: edgesplit trains classifiers, not regression"
    )


def from_arrays(x: np.ndarray, y: np.ndarray, num_classes: int | None = None) -> Dataset:
    """A dataset from numpy arrays: ``x`` [N, ...] (uint8 images are scaled to [0, 1], other
    integers are token ids), ``y`` [N] integer labels."""
    data = _from_arrays(np.asarray(x), np.asarray(y), "arrays")
    return data if num_classes is None else Dataset(data.x, data.y, num_classes)


def from_torch(dataset: object, num_classes: int | None = None) -> Dataset:
    """A dataset from any ``torch.utils.data.Dataset`` (or sequence) of ``(input, label)``
    pairs whose inputs are tensors, numpy arrays or PIL images of one size. It is read once,
    into memory, as every client's share is sliced from it."""
    try:
        count = len(dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise ConfigError("data: the dataset has no len(); pass a map-style Dataset") from error
    xs, ys = [], []
    for index in range(count):
        item = dataset[index]  # type: ignore[index]
        if not isinstance(item, tuple | list) or len(item) < 2:
            raise ConfigError(f"data: item {index} is not an (input, label) pair")
        xs.append(_as_array(item[0], index))
        ys.append(int(item[1]))
    shapes = {x.shape for x in xs}
    if len(shapes) > 1:
        raise ConfigError(f"data: inputs differ in shape {sorted(shapes)[:4]}; resize them")
    stacked = np.stack(xs) if xs else np.zeros((0, 1), dtype=np.float32)
    if stacked.dtype == np.uint8 and stacked.ndim == 4 and stacked.shape[-1] in (1, 3, 4):
        stacked = stacked.transpose(0, 3, 1, 2)  # PIL images: [N, H, W, C] -> [N, C, H, W]
    return from_arrays(stacked, np.array(ys, dtype=np.int64), num_classes)


def _as_array(value: object, index: int) -> np.ndarray:
    if hasattr(value, "detach"):  # a tensor
        return np.asarray(value.detach().cpu().numpy())
    array = np.asarray(value)
    if array.dtype == object:
        raise ConfigError(f"data: input {index} is a {type(value).__name__}, not an array")
    return array


def _npz(path: str) -> Dataset:
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # one .npy array under this name
            raise ConfigError(
                f"npz:{path}: cannot be read: not an npz archive (numpy.savez writes one; "
                "this file holds a single array, from numpy.save)"
            )
        with loaded as archive:
            if "x" not in archive or "y" not in archive:
                raise ConfigError(
                    f"npz:{path}: expected arrays 'x' and 'y', found {sorted(archive.files)}"
                )
            return _from_arrays(archive["x"], archive["y"], f"npz:{path}")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"npz:{path}: cannot be read: {_npz_problem(path, error)}") from error


def _npz_problem(path: str, error: Exception) -> str:
    """Why ``path`` did not load: a file that is no zip archive (or a truncated one) is named
    as such, not by numpy's guess that it might be a pickle."""
    try:
        with open(path, "rb") as file:
            zipped = file.read(4) == b"PK\x03\x04"
    except OSError:
        return str(error)
    if isinstance(error, zipfile.BadZipFile) or not zipped:
        what = "a damaged or truncated one" if zipped else "something else"
        return f"not an npz archive (numpy.savez writes one; this file is {what})"
    return str(error)


def _optional(module: str, purpose: str) -> object:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"{purpose} needs the package {module.split('.')[0]!r}; install it or use npz:PATH"
        ) from error


def _digits() -> Dataset:
    datasets = _optional("sklearn.datasets", "the 'digits' dataset")
    bunch = datasets.load_digits()  # type: ignore[attr-defined]
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    return Dataset(x, bunch.target.astype(np.int64), 10)


def _folder(path: str) -> Dataset:
    image = _optional("PIL.Image", "folder:PATH")
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"folder:{path}: no such folder")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise ConfigError(f"folder:{path}: expected one sub-folder per class")
    numbered = all(name.isdigit() and name.isascii() for name in classes)
    labels = [int(name) for name in classes] if numbered else list(range(len(classes)))
    pictures, ys, files = [], [], []
    for label, name in zip(labels, classes, strict=True):
        for file in sorted((root / name).iterdir()):
            if file.suffix.lower() in _IMAGE_SUFFIXES:
                pictures.append(_image(image, file))
                ys.append(label)
                files.append(file)
    if not pictures:
        suffixes = ", ".join(sorted(_IMAGE_SUFFIXES))
        raise ConfigError(f"folder:{path}: its class folders hold no images ({suffixes})")
    sizes = {p.size for p in pictures}
    if len(sizes) != 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes))
        odd = next(i for i, p in enumerate(pictures) if p.size != pictures[0].size)
        (w, h), first = pictures[odd].size, files[0].relative_to(root)
        raise ConfigError(
            f"folder:{path}: images differ in size ({shown}): {files[odd].relative_to(root)} "
            f"is {w}x{h}, {first} {pictures[0].size[0]}x{pictures[0].size[1]}; resize them"
        )
    color = any(p.mode not in _GRAY_MODES for p in pictures)  # one colour image: all RGB
    stacked = np.stack([_pixels(p, color) for p in pictures])
    # [N, H, W, C] -> [N, C, H, W]; grayscale gets its channel axis
    stacked = stacked.transpose(0, 3, 1, 2) if stacked.ndim == 4 else stacked[:, None]
    x, y = np.ascontiguousarray(stacked), np.array(ys, dtype=np.int64)
    if numbered:  # folders named by label: a folder without some class is still right
        return Dataset(x, y, max(labels) + 1)
    return Dataset(x, y, len(classes), tuple(classes))


# grayscale modes past 8 bits, by the value read as white: integer ones (PNG's 16-bit,
# which Pillow may also open as "I") from 65,535; floating-point ones are in [0, 1] already
_WIDE_MODES = dict.fromkeys(("I", "I;16", "I;16B", "I;16L", "I;16N"), 65535.0) | {"F": 1.0}
_GRAY_MODES = frozenset({"1", "L", "LA", *_WIDE_MODES})  # with alpha: dropped


def _pixels(picture: Any, color: bool) -> np.ndarray:
    """float32 in [0, 1]: [H, W] grayscale, or [H, W, 3] RGB when ``color`` (palette, alpha
    and CMYK images converted; 16-bit grayscale scaled from 65,535, not read as token ids)."""
    if picture.mode in _WIDE_MODES:
        gray = np.asarray(picture, dtype=np.float32) / _WIDE_MODES[picture.mode]
        gray = np.clip(gray, 0.0, 1.0)
        return np.repeat(gray[..., None], 3, axis=-1) if color else gray
    converted = picture.convert("RGB" if color else "L")
    return np.asarray(converted, dtype=np.float32) / 255.0


def _image(image: Any, file: Path) -> Any:
    """One image file, read (a file that is not an image is a :class:`ConfigError`)."""
    try:
        with image.open(file) as picture:
            picture.load()
            return picture.copy()
    except (OSError, ValueError, image.DecompressionBombError) as error:
        # UnidentifiedImageError is an OSError; a decompression bomb (a hostile file) is not
        raise ConfigError(f"folder: {file} is not an image that can be read: {error}") from error


def _torchvision(spec: str) -> Dataset:
    name, _, root = spec.partition(":")
    datasets = _optional("torchvision.datasets", "torchvision:NAME:ROOT")
    factory = getattr(datasets, name, None)
    if factory is None:
        raise ConfigError(f"torchvision:{spec}: torchvision has no dataset {name!r}")
    takes_root = "root" in inspect.signature(factory).parameters
    try:  # no download: the datasets that can fetch default to not
        data = factory(root=root or ".") if takes_root else factory()
    except (RuntimeError, OSError, TypeError, ValueError) as error:
        raise ConfigError(f"torchvision:{spec}: cannot be read: {error}") from error
    if hasattr(data, "data") and hasattr(data, "targets"):  # MNIST, CIFAR: arrays in memory
        x = np.asarray(data.data)
        y = np.asarray(data.targets)
        x = x if x.ndim != 4 or x.shape[-1] not in (1, 3) else x.transpose(0, 3, 1, 2)
        return _from_arrays(x, y, f"torchvision:{spec}")
    return from_torch(data)  # ImageFolder, FakeData...


_KINDS = ("npz", "folder", "torchvision")


def _with_kind(spec: str, folder: str | Path = ".") -> str:
    """A bare path as users write it, with its kind: ``train.npz`` is ``npz:train.npz``, an
    existing folder (relative to ``folder``) is ``folder:PATH``; anything else as it is."""
    kind = spec.partition(":")[0]
    if kind in _KINDS or spec == "digits":
        return spec
    if spec.endswith(".npz"):
        return f"npz:{spec}"
    if (Path(folder) / spec).is_dir():
        return f"folder:{spec}"
    return spec


def resolve_spec(spec: str, folder: str | Path) -> str:
    """``spec`` with a relative path made relative to ``folder`` (a config file's)."""
    spec = _with_kind(spec, folder)
    kind, _, rest = spec.partition(":")
    if kind in ("npz", "folder") and rest and not Path(rest).is_absolute():
        return f"{kind}:{Path(folder) / rest}"
    if kind == "torchvision" and rest:
        name, _, root = rest.partition(":")
        if root and not Path(root).is_absolute():
            return f"torchvision:{name}:{Path(folder) / root}"
    return spec


def load_dataset(spec: str) -> Dataset:
    """Load a dataset from a spec such as ``npz:data/train.npz`` (or ``data/train.npz``),
    ``digits``, ``folder:photos`` (or an existing folder ``photos``)."""
    spec = _with_kind(spec)
    kind, _, rest = spec.partition(":")
    if kind == "npz" and rest:
        return _npz(rest)
    if spec == "digits":
        return _digits()
    if kind == "folder" and rest:
        return _folder(rest)
    if kind == "torchvision" and rest:
        return _torchvision(rest)
    raise ConfigError(
        f"data: unknown dataset spec {spec!r}; use npz:PATH, digits, "
        "folder:PATH or torchvision:NAME:ROOT"
    )


def partition(
    labels: np.ndarray,
    clients: int,
    kind: str = "iid",
    *,
    alpha: float = 0.5,
    per_client: int = 2,
    seed: int = 0,
) -> list[np.ndarray]:
    """Indices of each client's samples: disjoint, covering every sample, none empty."""
    if clients < 1 or clients > len(labels):
        raise ConfigError(
            f"clients: need 1..{len(labels)} clients for {len(labels)} samples, got {clients}"
        )
    if labels.ndim > 1 and kind != "iid":
        raise ConfigError(
            f"partition.kind: {kind!r} splits by label; with a label per position (language "
            "modelling) use iid"
        )
    rng = np.random.default_rng(seed)
    if kind == "iid":
        parts = np.array_split(rng.permutation(len(labels)), clients)
    elif kind == "dirichlet":
        if not alpha > 0:
            raise ConfigError(f"partition.alpha: must be > 0, got {alpha}")
        parts = _dirichlet(labels, clients, alpha, rng)
    elif kind == "shards":
        if per_client < 1:
            raise ConfigError(f"partition.per_client: must be >= 1, got {per_client}")
        order = np.argsort(labels, kind="stable")
        # At most one shard per sample, so none is empty; still >= clients shards.
        shards = np.array_split(order, min(clients * per_client, len(labels)))
        assignment = rng.permutation(len(shards))
        parts = [
            np.concatenate([shards[s] for s in assignment[c::clients]]) for c in range(clients)
        ]
    else:
        raise ConfigError(f"partition.kind: {kind!r} is not one of {PARTITIONS}")
    return [np.sort(p) for p in parts]


def _dirichlet(
    labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each class spread over clients by Dirichlet(alpha) shares; empty clients get one sample
    from the largest, so every client can train."""
    buckets: list[list[int]] = [[] for _ in range(clients)]
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        shares = rng.dirichlet(np.full(clients, alpha))
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for client, chunk in enumerate(np.split(members, cuts)):
            buckets[client].extend(chunk.tolist())
    for client in range(clients):
        if not buckets[client]:
            donor = max(range(clients), key=lambda c: len(buckets[c]))
            buckets[client].append(buckets[donor].pop())
    return [np.array(b, dtype=np.int64) for b in buckets]
