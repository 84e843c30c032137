"""Dataset loading and client partitions."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from split_models.data import (
    batch_count,
    batch_slices,
    from_arrays,
    from_torch,
    input_problem,
    load_dataset,
    model_data_problem,
    partition,
    resolve_spec,
    shaped_for,
    trained_examples,
)
from split_models.errors import ConfigError
from split_models.options import ModelOptions

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_mnist.npz"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist8k.npz"


def test_npz_images_get_a_channel_axis_and_unit_range() -> None:
    data = load_dataset(f"npz:{FIXTURE}")
    assert data.x.shape == (240, 1, 28, 28) and data.x.dtype == np.float32
    assert data.x.min() >= 0.0 and data.x.max() <= 1.0 and data.x.max() > 0.9
    assert data.y.dtype == np.int64 and data.num_classes == 10 and data.input_shape == (1, 28, 28)
    train, test = data.split(0.25, seed=1)
    assert (len(train), len(test)) == (180, 60)


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data/mnist8k.npz is not present")
def test_the_shared_mnist_sample_loads() -> None:
    data = load_dataset(f"npz:{SHARED}")
    assert len(data) == 8000 and data.num_classes == 10


def test_whole_number_float_labels_are_class_indices(tmp_path: Path) -> None:
    np.savez(tmp_path / "table.npz", x=np.zeros((3, 4)), y=np.array([0.0, 2.0, 1.0]))
    data = load_dataset(f"npz:{tmp_path / 'table.npz'}")
    assert data.y.dtype == np.int64 and data.y.tolist() == [0, 2, 1]
    assert data.num_classes == 3
    np.savez(tmp_path / "flags.npz", x=np.zeros((2, 4)), y=np.array([True, False]))
    assert load_dataset(f"npz:{tmp_path / 'flags.npz'}").y.tolist() == [1, 0]


def test_bad_npz_files_are_rejected(tmp_path: Path) -> None:
    np.savez(tmp_path / "no_y.npz", x=np.zeros((3, 4)))
    with pytest.raises(ConfigError, match="expected arrays 'x' and 'y'"):
        load_dataset(f"npz:{tmp_path / 'no_y.npz'}")
    np.savez(tmp_path / "objects.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1, int))
    with pytest.raises(ConfigError, match="cannot be read"):  # no pickle, ever
        load_dataset(f"npz:{tmp_path / 'objects.npz'}")
    np.savez(tmp_path / "float_labels.npz", x=np.zeros((3, 4)), y=np.array([0.0, 1.5, 2.0]))
    with pytest.raises(ConfigError, match="float64 values that are not whole numbers"):
        load_dataset(f"npz:{tmp_path / 'float_labels.npz'}")
    np.savez(tmp_path / "names.npz", x=np.zeros((3, 4)), y=np.array(["cat", "dog", "cat"]))
    with pytest.raises(ConfigError, match=r"2 named classes \('cat', 'dog'\): map them"):
        load_dataset(f"npz:{tmp_path / 'names.npz'}")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_dataset(f"npz:{tmp_path / 'missing.npz'}")
    with pytest.raises(ConfigError, match="unknown dataset spec"):
        load_dataset("imagenet")


def test_a_damaged_or_foreign_file_is_named_not_an_npz_archive(tmp_path: Path) -> None:
    np.savez(tmp_path / "good.npz", x=np.zeros((30, 4)), y=np.zeros(30, int))
    whole = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])  # a copy that stopped
    (tmp_path / "text.npz").write_text("x,y\n1,2\n")
    (tmp_path / "empty.npz").write_bytes(b"")
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    for name, what in (
        ("cut", "damaged or truncated"),
        ("text", "something else"),
        ("empty", "something else"),
        ("one", "a single array"),
    ):
        with pytest.raises(ConfigError, match=f"not an npz archive .*{what}"):
            load_dataset(f"npz:{tmp_path / name}.npz")


def test_a_file_in_an_image_folder_that_is_no_image_is_named(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        image.new("L", (4, 4)).save(tmp_path / label / "ok.png")
    (tmp_path / "b" / "broken.png").write_text("not a picture")
    with pytest.raises(ConfigError, match=r"broken\.png is not an image"):
        load_dataset(f"folder:{tmp_path}")


def test_data_a_model_cannot_take_is_named_before_training() -> None:
    ids = ModelOptions("int64", (0, 64))
    tokens = from_arrays(np.arange(60, dtype=np.int64).reshape(6, 10) % 64, np.zeros(6, int), 2)
    assert input_problem(tokens, ids) is None
    assert input_problem(tokens, ModelOptions()) is None  # floats: no range to hold
    for bad, span in ((70, "[1, 70]"), (-3, "[-3, 59]")):
        x = tokens.x.copy()
        x[0, 0] = bad
        problem = input_problem(from_arrays(x, tokens.y, 2), ids)
        assert problem is not None and f"token ids span {span}" in problem and "[0, 64)" in problem
    empty = from_arrays(np.zeros((0, 4), np.float32), np.zeros(0, int), 2)
    assert input_problem(empty, ModelOptions()) == "it holds no samples"


@pytest.mark.parametrize(
    ("spec", "module"),
    [("digits", "sklearn"), ("folder:x", "PIL"), ("torchvision:MNIST:x", "torchvision")],
)
def test_optional_sources_say_what_to_install(
    spec: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    with pytest.raises(ConfigError, match=f"needs the package '{module}'"):
        load_dataset(spec)


@settings(max_examples=60, deadline=None)
@given(
    samples=st.integers(10, 300),
    clients=st.integers(1, 10),
    kind=st.sampled_from(["iid", "dirichlet", "shards"]),
    seed=st.integers(0, 5),
)
def test_partitions_are_disjoint_complete_and_never_empty(
    samples: int, clients: int, kind: str, seed: int
) -> None:
    labels = np.random.default_rng(seed).integers(0, 10, samples)
    parts = partition(labels, clients, kind, alpha=0.3, per_client=2, seed=seed)
    joined = np.concatenate(parts)
    assert len(parts) == clients and all(len(p) > 0 for p in parts)
    assert sorted(joined.tolist()) == list(range(samples))


def test_label_skew_grows_as_alpha_shrinks_and_shards_limit_classes() -> None:
    labels = load_dataset(f"npz:{FIXTURE}").y

    def classes(parts: list[np.ndarray]) -> float:
        return float(np.mean([len(np.unique(labels[p])) for p in parts]))

    iid = classes(partition(labels, 8, "iid"))
    skewed = classes(partition(labels, 8, "dirichlet", alpha=0.05))
    shards = partition(labels, 8, "shards", per_client=2)
    assert skewed < iid
    assert max(len(np.unique(labels[p])) for p in shards) <= 4
    with pytest.raises(ConfigError, match=r"partition\.kind"):
        partition(labels, 2, "by-colour")
    with pytest.raises(ConfigError, match="clients"):
        partition(labels, 0)


def test_integer_arrays_other_than_uint8_are_token_ids(tmp_path: Path) -> None:
    ids = np.array([[1, 5, 63], [0, 2, 9]], dtype=np.int32)
    np.savez(tmp_path / "tokens.npz", x=ids, y=np.array([0, 1]))
    data = load_dataset(f"npz:{tmp_path / 'tokens.npz'}")
    assert data.x.dtype == np.int64 and np.array_equal(data.x, ids)
    assert data.input_shape == (3,)


def test_a_torch_dataset_of_pairs_is_read_into_arrays() -> None:
    import torch
    from torch.utils.data import TensorDataset

    images = torch.rand(6, 1, 4, 4)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    data = from_torch(TensorDataset(images, labels))
    assert data.x.shape == (6, 1, 4, 4) and data.x.dtype == np.float32
    assert np.allclose(data.x, images.numpy()) and data.num_classes == 3
    pil_like = [(np.full((4, 4, 3), 255, np.uint8), 1), (np.zeros((4, 4, 3), np.uint8), 0)]
    colour = from_torch(pil_like, num_classes=2)
    assert colour.x.shape == (2, 3, 4, 4) and float(colour.x.max()) == 1.0
    with pytest.raises(ConfigError, match="differ in shape"):
        from_torch([(np.zeros(3), 0), (np.zeros(4), 1)])
    with pytest.raises(ConfigError, match=r"not an \(input, label\) pair"):
        from_torch([np.zeros(3)])


def test_relative_data_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    assert resolve_spec("npz:data/train.npz", tmp_path) == f"npz:{tmp_path / 'data/train.npz'}"
    assert resolve_spec("npz:/abs/x.npz", tmp_path) == "npz:/abs/x.npz"
    assert resolve_spec("digits", tmp_path) == "digits"
    assert resolve_spec("torchvision:MNIST:data", tmp_path) == (
        f"torchvision:MNIST:{tmp_path / 'data'}"
    )
    assert resolve_spec("folder:imgs", tmp_path) == f"folder:{tmp_path / 'imgs'}"


def test_a_bare_npz_path_or_folder_is_taken_as_what_it_is(tmp_path: Path) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((4, 1, 2, 2), np.float32), y=np.arange(4))
    (tmp_path / "photos").mkdir()
    assert len(load_dataset(str(tmp_path / "train.npz"))) == 4
    assert resolve_spec("train.npz", tmp_path) == f"npz:{tmp_path / 'train.npz'}"
    assert resolve_spec("photos", tmp_path) == f"folder:{tmp_path / 'photos'}"
    assert resolve_spec("digits", tmp_path) == "digits"
    with pytest.raises(ConfigError, match="unknown dataset spec 'nowhere'"):
        load_dataset(str(tmp_path / "nowhere").replace(str(tmp_path) + "/", ""))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5, 0.9, 1.0]))
def test_trained_examples_counts_what_an_edges_split_keeps(examples: int, share: float) -> None:
    """The planner counts an edge's batches from its announced examples with this rule; the
    edge holds its federated-evaluation share out with ``Dataset.split``: they must agree."""
    data = from_arrays(np.zeros((examples, 1, 2, 2), np.float32), np.zeros(examples, np.int64))
    kept = len(data.split(share)[0]) if 0 < share < 1 and examples >= 2 else examples
    assert trained_examples(examples, share) == kept


def test_data_of_another_shape_or_with_more_classes_names_the_key_to_fix() -> None:
    from coordinator.config import RunConfig
    from coordinator.service import _central
    from split_models.config import ModelConfig

    model = ModelConfig(name="cnn", input_shape=(1, 8, 8), num_classes=10)
    fits = from_arrays(np.zeros((4, 1, 8, 8), np.float32), np.arange(4), 10)
    assert model_data_problem(fits, model) is None
    wide = from_arrays(np.zeros((4, 1, 28, 28), np.float32), np.arange(4), 10)
    many = from_arrays(np.zeros((4, 1, 8, 8), np.float32), np.array([0, 1, 2, 12]), 13)
    problems = [model_data_problem(d, model, "eval_data") for d in (wide, many)]
    assert problems == [
        "input_shape: the eval_data has samples of shape [1, 28, 28], the config says [1, 8, 8]"
        "; set input_shape: [1, 28, 28] (--input-shape 1,28,28)",
        "num_classes: the eval_data has labels up to 12, the model 10 outputs; set num_classes "
        "to 13 or more",
    ]
    # an edge's own data: the run's config is not the edge's to change, its data is
    assert model_data_problem(wide, model, "local data", device=True) == (
        "input_shape: the local data has samples of shape [1, 28, 28], the config says "
        "[1, 8, 8]; give this device samples of shape [1, 8, 8], as the run's model takes"
    )
    run = RunConfig.parse(
        {
            "run_id": "r",
            "model": "cnn",
            "input_shape": [1, 8, 8],
            "num_classes": 10,
            "rounds": 1,
            "devices": {"edges": 1},
        }
    )
    with pytest.raises(ConfigError, match="eval_data has labels up to 12"):
        _central(run, many)  # the coordinator refuses at start, not after a round trained


def test_labels_of_another_shape_than_the_task_takes_are_named() -> None:
    """Labels [N, 1] crashed a classification run mid-round (cross-entropy wants [N])."""
    from split_models.config import ModelConfig

    model = ModelConfig(name="cnn", input_shape=(1, 8, 8), num_classes=10)
    column = from_arrays(np.zeros((4, 1, 8, 8), np.float32), np.arange(4).reshape(4, 1), 10)
    problem = model_data_problem(column, model, "data")
    assert problem is not None and problem.startswith("task: a classification model")
    assert "labels of shape [4, 1]" in problem
    language = ModelConfig(
        name="tiny-gpt",
        input_shape=(6,),
        num_classes=16,
        input_dtype="int64",
        input_range=(0, 16),
        task="language-model",
    )
    tokens = np.arange(24, dtype=np.int64).reshape(4, 6) % 16
    assert model_data_problem(from_arrays(tokens, tokens, 16), language) is None
    one_each = model_data_problem(from_arrays(tokens, tokens[:, 0], 16), language)
    assert one_each is not None and "a label for every position" in one_each


def test_negative_labels_are_named_as_such() -> None:
    with pytest.raises(ConfigError, match=r"labels must be class indices from 0, found -1\.\.8"):
        from_arrays(np.zeros((10, 4), np.float32), np.arange(-1, 9))


def test_an_image_folder_of_mixed_modes_loads_as_one_kind_of_image(tmp_path: Path) -> None:
    """Grayscale, RGBA, palette and 16-bit PNGs beside RGB ones were refused as of another
    size, read as palette indices, or taken for token ids."""
    image = pytest.importorskip("PIL.Image")
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
    image.new("RGB", (4, 3), (255, 0, 0)).save(tmp_path / "a" / "rgb.png")
    image.new("L", (4, 3), 255).save(tmp_path / "a" / "gray.png")
    image.new("RGBA", (4, 3), (0, 255, 0, 128)).save(tmp_path / "b" / "rgba.png")
    image.new("RGB", (4, 3), (0, 0, 255)).convert("P").save(tmp_path / "b" / "palette.png")
    wide = image.fromarray(np.full((3, 4), 65535, dtype=np.uint16))
    wide.save(tmp_path / "b" / "sixteen.png")
    data = load_dataset(f"folder:{tmp_path}")
    assert data.x.shape == (5, 3, 3, 4) and data.x.dtype == np.float32
    assert list(data.y) == [0, 0, 1, 1, 1]
    pixels = [tuple(float(v) for v in data.x[i, :, 0, 0]) for i in range(5)]
    # by file name within a class: gray, rgb; palette, rgba, sixteen
    assert pixels == [(1, 1, 1), (1, 0, 0), (0, 0, 1), (0, 1, 0), (1, 1, 1)]


def test_a_grayscale_folder_stays_one_channel_and_bad_folders_are_named(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for label in ("a", "b"):
        (tmp_path / label).mkdir()
    with pytest.raises(ConfigError, match="its class folders hold no images"):
        load_dataset(f"folder:{tmp_path}")
    image.new("L", (4, 4), 51).save(tmp_path / "a" / "one.png")
    image.fromarray(np.full((4, 4), 13107, dtype=np.uint16)).save(tmp_path / "b" / "two.png")
    data = load_dataset(f"folder:{tmp_path}")
    assert data.x.shape == (2, 1, 4, 4)
    assert np.allclose(data.x[:, 0, 0, 0], [0.2, 0.2])
    image.new("L", (8, 8)).save(tmp_path / "b" / "big.png")
    with pytest.raises(ConfigError, match=r"images differ in size \(4x4, 8x8\)") as raised:
        load_dataset(f"folder:{tmp_path}")
    assert "b/big.png is 8x8, a/one.png 4x4" in str(raised.value), raised.value  # which one


def test_an_image_folder_missing_a_class_keeps_its_labels_or_is_refused(tmp_path: Path) -> None:
    """Labels were each folder's sorted position: an edge or test folder without class
    'eight' read 'nine' as 8, and a run scored 0.003 with no word why."""
    from split_models.config import ModelConfig

    image = pytest.importorskip("PIL.Image")
    model = ModelConfig(name="cnn", input_shape=(1, 4, 4), num_classes=4)
    for folder, names in (("numbered", ("0", "1", "3")), ("named", ("cat", "dog", "fox"))):
        for index, name in enumerate(names):
            (tmp_path / folder / name).mkdir(parents=True)
            image.new("L", (4, 4), 10 * index).save(tmp_path / folder / name / "a.png")

    numbered = load_dataset(f"folder:{tmp_path / 'numbered'}")
    assert list(numbered.y) == [0, 1, 3] and numbered.classes is None  # by the folders' names
    assert model_data_problem(numbered, model) is None

    named = load_dataset(f"folder:{tmp_path / 'named'}")
    assert list(named.y) == [0, 1, 2] and named.classes == ("cat", "dog", "fox")
    assert named.subset(np.array([2])).classes == named.classes
    problem = model_data_problem(named, model, "local data")
    assert problem is not None and problem.startswith("local data: its folder has 3 class folders")
    assert "add the missing class folders (empty ones will do)" in problem
    (tmp_path / "named" / "gnu").mkdir()  # an empty class folder keeps the numbering
    assert model_data_problem(load_dataset(f"folder:{tmp_path / 'named'}"), model) is None
    with pytest.raises(ConfigError, match="no such folder"):
        load_dataset(f"folder:{tmp_path / 'nowhere'}")


@pytest.mark.parametrize(
    ("x", "want", "shaped"),
    [
        (np.zeros((5, 1, 64), np.float32), (1, 64), (1, 64)),  # Conv1d: [N, C, L]
        (np.zeros((5, 20, 8), np.float32), (20, 8), (20, 8)),  # a GRU: [N, T, F]
        (np.zeros((5, 28, 28), np.uint8), (1, 28, 28), (1, 28, 28)),  # greyscale images
        (np.zeros((5, 28, 28), np.uint8), (28, 28), (28, 28)),
        (np.zeros((5, 64), np.float32), (1, 64), (1, 64)),
        (np.zeros((5, 3, 8), np.float32), (4, 8), (1, 3, 8)),  # no unit axis fits: as read
    ],
)
def test_a_unit_axis_is_added_or_dropped_to_fit_the_input_shape(
    tmp_path: Path, x: np.ndarray, want: tuple[int, ...], shaped: tuple[int, ...]
) -> None:
    """3-D arrays were always read as greyscale images, [N, 1, A, B]: 1-D and sequence
    models could not take their data at all."""
    np.savez(tmp_path / "d.npz", x=x, y=np.zeros(len(x), np.int64))
    data = shaped_for(load_dataset(f"npz:{tmp_path / 'd.npz'}"), want)
    assert data.input_shape == shaped and len(data) == 5


def test_integer_features_for_a_float_model_and_channels_last_images_are_named() -> None:
    from split_models.config import ModelConfig

    model = ModelConfig(name="cnn", input_shape=(1, 8, 8), num_classes=10)
    ids = from_arrays(np.zeros((4, 1, 8, 8), np.int32), np.arange(4), 10)
    assert str(model_data_problem(ids, model)).startswith(
        "input_dtype: the data holds integers, read as token ids, but the model takes "
        "float32: store images as uint8"
    )
    rgb = ModelConfig(name="cnn", input_shape=(3, 8, 8), num_classes=10)
    last = from_arrays(np.zeros((4, 8, 8, 3), np.float32), np.arange(4), 10)
    assert str(model_data_problem(last, rgb)).endswith(
        "the samples are channels-last: transpose x to [N, C, H, W]"
    )


def test_float_features_at_pixel_scale_are_warned_of() -> None:
    """Float images kept at 0-255 ended a run at chance, the warning blaming the lr."""
    from split_models.data import scale_warning

    pixels = np.random.default_rng(0).integers(0, 256, (8, 1, 4, 4))
    raw = from_arrays(pixels.astype(np.float32), np.arange(8) % 2, 2)
    said = scale_warning(raw, "data")
    assert said is not None and said.startswith("data: float features reach 255")
    assert "scale them if they are pixel values" in said
    assert scale_warning(from_arrays(pixels.astype(np.float32) / 255, np.arange(8) % 2, 2)) is None
    assert scale_warning(from_arrays(pixels, np.arange(8) % 2, 2)) is None  # token ids


@pytest.mark.parametrize("examples", [1, 2, 31, 32, 33, 34, 64, 65, 97])
def test_batches_cover_every_example_once_and_a_last_batch_of_one_joins_the_one_before(
    examples: int,
) -> None:
    order = np.random.default_rng(examples).permutation(examples)
    batches = batch_slices(order, 32)
    assert np.array_equal(np.concatenate(batches), order)
    assert len(batches) == batch_count(examples, 32)
    assert all(len(b) > 1 for b in batches) or examples == 1  # one example: one batch of one
    assert all(len(b) <= 33 for b in batches)
    if examples % 32 == 1 and examples > 1:
        assert len(batches[-1]) == 33


def test_no_examples_make_no_batches_and_batch_size_one_keeps_batches_of_one() -> None:
    assert batch_slices(np.arange(0), 32) == [] and batch_count(0, 32) == 0
    assert [len(b) for b in batch_slices(np.arange(5), 1)] == [1] * 5 == [1] * batch_count(5, 1)
