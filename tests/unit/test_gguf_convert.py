"""The streamed GGUF conversion (engine/gguf_convert.py) against transformers' own
``from_pretrained(gguf_file=...)``, and the packed layout against the full one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.synthetic_gguf import SHAPES, write_synthetic_gguf
from engine import gguf_convert, gguf_layout
from engine.loader import default_gguf_path, iter_safetensors, load_model, resolve_model_path
from engine.model_files import safetensors_files


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as transformers converts it, every tensor in memory at once."""
    out = tmp_path_factory.mktemp("whole")
    gguf_convert._convert_whole(default_gguf_path(), out)
    return out


@pytest.mark.slow  # two conversions of the default model, ~40 s
def test_streamed_conversion_equals_transformers_from_pretrained(
    reference_dir: Path, default_model_dir: Path
) -> None:
    want = load_file(str(reference_dir / "model.safetensors"))
    got = dict(iter_safetensors(default_model_dir))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name
    for file in ("config.json", "generation_config.json"):
        ref = json.loads((reference_dir / file).read_text())
        ours = json.loads((default_model_dir / file).read_text())
        ref.pop("transformers_version", None)
        ours.pop("transformers_version", None)
        assert ours == ref, file


@pytest.mark.slow
def test_small_shards_and_their_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_dir: Path
) -> None:
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 50 << 20)
    gguf_convert.convert_gguf(default_gguf_path(), tmp_path)
    files = safetensors_files(tmp_path)
    assert len(files) > 5  # 538 MB of float32 in shards of >= 50 MB
    index = json.loads((tmp_path / gguf_layout.INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 4 for _, t in iter_safetensors(default_model_dir)
    )
    want = dict(iter_safetensors(default_model_dir))
    got = dict(iter_safetensors(tmp_path))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_packed_layout_keeps_no_dense_copy_of_packable_tensors(default_model_dir: Path) -> None:
    packed_dir = resolve_model_path("default", packed=True)
    assert packed_dir != default_model_dir and gguf_layout.is_packed_layout(packed_dir)
    dense_bytes = sum(f.stat().st_size for f in safetensors_files(packed_dir))
    assert dense_bytes < 1e6  # the norms: 211 Q4_1/Q8_0 tensors left out, of 538 MB
    heads = gguf_layout.packed_heads(packed_dir)
    names = gguf_layout.packed_gguf_names(packed_dir)
    full = dict(iter_safetensors(default_model_dir))
    assert len(heads) == len(names) == 211
    for name, head in heads.items():
        # The first columns as the full conversion has them (q/k rows un-permuted).
        assert head.shape == (full[name].shape[0], gguf_layout.HEAD_COLS)
        assert torch.equal(head, full[name][:, : gguf_layout.HEAD_COLS]), name
    config = json.loads((packed_dir / "config.json").read_text())
    for name, tensor in gguf_layout.dense_from_gguf(default_gguf_path(), names, config):
        assert torch.equal(tensor, full[name]), name


@pytest.mark.slow
@torch.inference_mode()
def test_packed_layout_loads_dense_when_packing_is_off(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed_dir = resolve_model_path("default", packed=True)
    monkeypatch.setenv("HISERVE_GGUF_PACKED", "0")
    cpu = torch.device("cpu")
    got = load_model(packed_dir, cpu, torch.float32, "torch", gguf_path=default_gguf_path())
    want = load_model(default_model_dir, cpu, torch.float32, "torch")
    want_state = want.state_dict()
    for name, tensor in got.state_dict().items():
        assert torch.equal(tensor, want_state[name]), name
    with pytest.raises(ValueError, match="load it with its GGUF file"):
        load_model(packed_dir, cpu, torch.float32, "torch")


def _converting_here_fails(*args: object, **kwargs: object) -> None:
    raise AssertionError("the conversion ran in the server's own process")


def test_the_loader_converts_in_a_child_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every conversion writes its tensors through _stream_tensors; the spawned child
    # imports a fresh gguf_convert, where this patch is not.
    monkeypatch.setattr(gguf_convert, "_stream_tensors", _converting_here_fails)
    gguf = write_synthetic_gguf(tmp_path / "tiny.gguf", SHAPES["tiny"], default_gguf_path())
    out = resolve_model_path(str(gguf), cache_dir=str(tmp_path / "cache"), packed=True)
    assert gguf_layout.is_packed_layout(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_conversion_parses_the_header_three_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers parses it for the tokenizer and for the config, and the tensors are
    # read through one more reader. The metadata strings and the tensor processor used
    # to parse it three times more (3.9 s each for the default model), and the GGUF ->
    # HF name map was built once per submodule.
    import gguf

    path = write_synthetic_gguf(tmp_path / "tiny.gguf", SHAPES["tiny"], default_gguf_path())
    readers: list[str] = []
    name_maps: list[tuple[object, ...]] = []
    reader_init = gguf.GGUFReader.__init__
    name_map = gguf.get_tensor_name_map

    def counted_reader(self: object, *args: object, **kwargs: object) -> None:
        readers.append(str(args[0]))
        reader_init(self, *args, **kwargs)  # type: ignore[arg-type]

    def counted_name_map(*args: object) -> object:
        name_maps.append(args)
        return name_map(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counted_name_map)
    gguf_convert.convert_gguf(path, tmp_path / "out", packed=True)
    assert len(readers) == 3, readers
    assert len(name_maps) == 1, len(name_maps)
    assert gguf.get_tensor_name_map is counted_name_map  # put back


def test_a_failed_child_conversion_raises_its_error_here(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))  # a header and nothing else
    with pytest.raises(RuntimeError, match=r"converting .*bad\.gguf failed: \w+Error: ") as info:
        gguf_convert.convert_gguf_isolated(bad, tmp_path / "out")
    # The child's own exception, named: the cause reaches the caller.
    assert "exit code" not in str(info.value)


def test_modules_the_parent_hides_are_hidden_in_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The image build hides torch_musa (no MUSA driver during `docker build`); accelerate,
    # which the conversion imports, would import it and fail. A hidden transformers stands
    # in for it here: the child must fail at the conversion's first import of it.
    monkeypatch.setitem(sys.modules, "transformers", None)
    gguf = write_synthetic_gguf(tmp_path / "tiny.gguf", SHAPES["tiny"], default_gguf_path())
    with pytest.raises(RuntimeError, match=r"failed: ModuleNotFoundError: .*transformers"):
        gguf_convert.convert_gguf_isolated(gguf, tmp_path / "out")


_NO_MAIN_GUARD = """
import sys
from engine import Engine, EngineConfig, SamplingParams
engine = Engine(EngineConfig(model=sys.argv[1], device="cpu", kv_cache_tokens=512,
                             cache_dir=sys.argv[2]))
print(engine.generate([[1, 2, 3]], [SamplingParams(max_tokens=2, temperature=0)])[0].token_ids)
engine.close()
"""


@pytest.mark.slow  # a first conversion: ~20 s
def test_a_script_without_a_main_guard_converts_on_first_use(tmp_path: Path) -> None:
    # A spawned conversion worker used to run the parent's script again: it built a second
    # Engine there, which waited forever for the conversion lock its parent held.
    gguf = write_synthetic_gguf(tmp_path / "tiny.gguf", SHAPES["tiny"], default_gguf_path())
    script = tmp_path / "serve_once.py"
    script.write_text(_NO_MAIN_GUARD)
    done = subprocess.run(
        [sys.executable, str(script), str(gguf), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(done.stdout.strip().splitlines()[-1])) == 2
