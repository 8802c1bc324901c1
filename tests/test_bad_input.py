"""Bad input, swept: the command line and the public API refuse each mistake in their own words.

- ``python -m tiermem plan`` (run through ``main(argv)``, and a few through a real subprocess):
  exit status 2, nothing on stdout, exactly one line on stderr, no traceback.
- The public API: a tiermem error that is also a ValueError or a TypeError, raised before any GPU
  check (this machine has no GPU and no cuda-bindings, so meeting that check would raise
  CUDAUnavailableError instead), with nothing changed: no default Tier made, and the model's
  parameters the same objects, at the same addresses, holding the same values.
- A corrupt checkpoint is refused by ``plan`` and ``load_pretrained`` with the same message, which
  names the file and what is wrong with it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import tiermem
from tiermem.base import default as _default
from tiermem.cli.main import main
from tiermem.errors import CheckpointError, ConfigError, CUDAUnavailableError, TierMemError
from tiermem.pytorch.wrap import TIERED_ATTR

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             vocab_size=256, tie_word_embeddings=False)
TINY = [f"{k}={json.dumps(v)}" for k, v in SMALL.items()]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    # What the command sets for itself (TRANSFORMERS_VERBOSITY), restored after each test.
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    for k in [k for k in os.environ if k.startswith("TIERMEM_")]:
        monkeypatch.delenv(k)


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``python -m tiermem plan *argv``, in this process."""
    try:
        code = main(["plan", *argv])
    except SystemExit as e:          # argparse's own errors exit from inside the parser
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line(code: int, out: str, err: str, *fragments: str) -> None:
    assert code == 2, (code, err)
    assert out == "", out
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, (f, err)


# ---------------------------------------------------------------------------------------------
# The command line: options and model names

CLI_CASES = [
    (["--link-gbps", "0"], "argument --link-gbps: expected a positive, finite number of GB/s, got '0'"),
    (["--link-gbps=-5"], "got '-5'"),
    (["--link-gbps", "nan"], "got 'nan'"),
    (["--link-gbps", "inf"], "got 'inf'"),
    (["--link-gbps", "fast"], "got 'fast'"),
    (["--disk-gbps", "0"], "argument --disk-gbps: expected a positive"),
    (["--disk-gbps=-1"], "argument --disk-gbps"),
    (["--tokens", "0"], "argument --tokens: expected a whole number of at least 1, got '0'"),
    (["--tokens=-5"], "argument --tokens"),
    (["--tokens", "1.5"], "argument --tokens"),
    (["--groups=-1"], "argument --groups: expected a whole number of at least 0, got '-1'"),
    (["--budget", "150%"], "is more than 100%"),
    (["--budget", "lots"], "budget='lots' is not a size"),
    (["--budget=-1GB"], "sizes are not negative"),
    (["--budget", "25%"], "--budget 25% is a share of the device's memory: give --device-memory"),
    (["--device-memory", "0"], "device memory must be more than 0 bytes"),
    (["--device-memory", "50%"], "a percentage"),
    (["--host-budget", "lots"], "host budget='lots' is not a size"),
    (["--host-budget", "10%"], "a percentage"),
    (["--dtype", "int8"], "dtype='int8' is not a dtype weights are built in"),
    (["--dtype", "bogus"], "dtype='bogus' is not a dtype"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("args, fragment", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_a_bad_option_is_one_line(capsys, args, fragment):
    argv = ["llama", *TINY, "--budget", "1MB", *args]
    assert_one_line(*plan(capsys, *argv), fragment)


def test_a_missing_budget_is_one_line(capsys):
    assert_one_line(*plan(capsys, "llama"), "the following arguments are required: --budget")


MODEL_CASES = [
    (["nonexistentmodel"], "'nonexistentmodel' is not a model type transformers"),
    (["lama"], "(close: llama"),
    (["vit"], "vit (ViTConfig) is not a causal language model"),
    (["t5"], "t5 (T5Config) is an encoder-decoder model"),
    (["resnet"], "is not a causal language model"),
    (["llama", "hidden_size"], "override 'hidden_size' is not field=value"),
    (["llama", "=64"], "override '=64' is not field=value"),
    (["llama", "hiden_size=64"], "llama has no field 'hiden_size'; did you mean 'hidden_size'?"),
    (["llama", "hidden_size=abc"], "hidden_size='abc': llama's hidden_size is an int"),
    (["llama", "hidden_size=true"], "hidden_size=True: llama's hidden_size is an int"),
    (["llama", "num_hidden_layers=-1"], "num_hidden_layers=-1: a model's num_hidden_layers is at least 1"),
    # Refused by transformers, when it makes the config or builds the model (the version decides which).
    (["llama", "hidden_size=64", "num_attention_heads=4", 'hidden_act="bogus"'], "'bogus'"),
    (["/nonexistent/folder"], "/nonexistent/folder does not exist"),
    (["missing.json"], "missing.json does not exist"),
]


@pytest.mark.parametrize("args, fragment", MODEL_CASES, ids=[" ".join(a) for a, _ in MODEL_CASES])
def test_a_bad_model_is_one_line(capsys, args, fragment):
    code, out, err = plan(capsys, *args, "--budget", "1MB")
    assert_one_line(code, out, err, fragment)
    assert len(err) < 400, err          # not the list of every model transformers knows


def test_help_says_what_is_planned_and_the_list_is_there(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "causal language model" in text and "--list-models" in text and "(ViT, T5) are not planned" in text
    assert "any transformers model" not in text
    with pytest.raises(SystemExit) as e:
        main(["plan", "--list-models"])
    listed = capsys.readouterr().out.splitlines()
    assert e.value.code == 0 and {"llama", "qwen2", "mixtral", "gpt2"} <= set(listed) and "vit" not in listed


# ---------------------------------------------------------------------------------------------
# Config files and checkpoints: refused by plan and load_pretrained alike

@pytest.fixture(scope="module")
def good(tmp_path_factory):
    import transformers
    root = tmp_path_factory.mktemp("ckpt")
    cfg = transformers.AutoConfig.for_model("llama", dtype="float32", **SMALL)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "shards", max_shard_size="100KB")
    assert (root / "shards" / "model.safetensors.index.json").exists()
    return root


def _header(f: Path, change) -> None:
    """Rewrite a safetensors file's JSON header through ``change(header)``."""
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    head = json.loads(b[8:8 + n])
    change(head)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + b[8 + n:])


def _first(head: dict) -> dict:
    return head[sorted(k for k in head if k != "__metadata__")[0]]


def _resave(f: Path, change) -> None:
    from safetensors.torch import load_file, save_file
    sd = load_file(f)
    change(sd)
    save_file(sd, f, metadata={"format": "pt"})


def _config(folder: Path, change) -> None:
    d = json.loads((folder / "config.json").read_text())
    change(d)
    (folder / "config.json").write_text(json.dumps(d))


def _wrong_shape(sd):
    k = "model.embed_tokens.weight"
    sd[k] = sd[k][:-1].clone()


# name: (source folder, how to corrupt it, the file named, what the message says)
CORRUPT = {
    "truncated": ("one", lambda d: os.truncate(d / "model.safetensors", os.path.getsize(d / "model.safetensors") // 2),
                  "model.safetensors", "the file is truncated"),
    "random bytes": ("one", lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)),
                     "model.safetensors", "not a safetensors file"),
    "a few bytes": ("one", lambda d: (d / "model.safetensors").write_bytes(b"abc"), "model.safetensors",
                    "too short for a safetensors header"),
    "header not JSON": ("one", lambda d: _header_bytes(d / "model.safetensors", b"{not json at all"),
                        "model.safetensors", "the safetensors header is not valid JSON"),
    "header a list": ("one", lambda d: _header_bytes(d / "model.safetensors", b"[1, 2, 3]"),
                      "model.safetensors", "not an object of tensors"),
    "dtype unknown": ("one", lambda d: _header(d / "model.safetensors", lambda h: _first(h).update(dtype="X9")),
                      "model.safetensors", "has dtype 'X9', which tiermem cannot read"),
    "shape and bytes differ": ("one", lambda d: _header(d / "model.safetensors",
                                                        lambda h: _first(h).update(shape=[3, 3])),
                               "model.safetensors", "needs 36 bytes but its entry spans"),
    "negative shape": ("one", lambda d: _header(d / "model.safetensors", lambda h: _first(h).update(shape=[-1, 4])),
                       "model.safetensors", "not a list of sizes"),
    "offsets past the end": ("one", lambda d: _header(d / "model.safetensors", lambda h: _first(h).update(
        data_offsets=[10**9, 10**9 + _first(h)["data_offsets"][1] - _first(h)["data_offsets"][0]])),
        "model.safetensors", "offsets point past its end"),
    "offsets reversed": ("one", lambda d: _header(d / "model.safetensors",
                                                  lambda h: _first(h).update(data_offsets=[8, 4])),
                         "model.safetensors", "not a [begin, end] byte range"),
    "entry malformed": ("one", lambda d: _header(d / "model.safetensors", lambda h: _first(h).pop("shape")),
                        "model.safetensors", "has a malformed entry"),
    "index not JSON": ("shards", lambda d: (d / "model.safetensors.index.json").write_text("{oops"),
                       "model.safetensors.index.json", "not valid JSON"),
    "index without weight_map": ("shards", lambda d: (d / "model.safetensors.index.json").write_text("{}"),
                                 "model.safetensors.index.json", "no weight_map"),
    "shard missing": ("shards", lambda d: os.remove(sorted(d.glob("model-*.safetensors"))[-1]),
                      "model-", "shard(s) that are missing"),
    "tensor of another shape": ("one", lambda d: _resave(d / "model.safetensors", _wrong_shape), "model.safetensors",
                                "model.embed_tokens.weight: float32 [255, 64] where the module has float32 [256, 64]"),
    "tensor missing": ("one", lambda d: _resave(d / "model.safetensors", lambda sd: sd.pop("lm_head.weight")),
                       "", "lack 1 tensor(s) the module needs"),
    "config without hidden_size": ("one", lambda d: _config(d, lambda c: c.pop("hidden_size")), "model.safetensors",
                                   "config.json does not set hidden_size, so transformers' defaults were used"),
    "config without model_type": ("one", lambda d: _config(d, lambda c: c.pop("model_type")), "config.json",
                                  "has no model_type"),
    "config not JSON": ("one", lambda d: (d / "config.json").write_text("{'model_type': 'llama'}"), "config.json",
                        "is not valid JSON"),
    "config unknown type": ("one", lambda d: _config(d, lambda c: c.update(model_type="lamma")), "config.json",
                            "model_type 'lamma' is not a model type transformers"),
    "config of a ViT": ("one", lambda d: (d / "config.json").write_text('{"model_type": "vit"}'), "",
                        "vit (ViTConfig) is not a causal language model"),
    "config missing": ("one", lambda d: os.remove(d / "config.json"), "", "has no config.json"),
}


def _header_bytes(f: Path, text: bytes) -> None:
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    f.write_bytes(len(text).to_bytes(8, "little") + text + b[8 + n:])


@pytest.fixture
def corrupt(good, tmp_path, request):
    src, change, _, _ = CORRUPT[request.param]
    d = tmp_path / "bad"
    shutil.copytree(good / src, d)
    change(d)
    return d


@pytest.mark.parametrize("corrupt", list(CORRUPT), indirect=True)
def test_a_corrupt_checkpoint_is_refused_by_plan_and_load_pretrained_alike(capsys, corrupt, request):
    _, _, names, says = CORRUPT[request.node.callspec.params["corrupt"]]
    with pytest.raises(TierMemError) as e:
        tiermem.load_pretrained(corrupt, budget="1MB")
    err = e.value
    assert isinstance(err, (CheckpointError, ConfigError)) and isinstance(err, ValueError), err
    assert not isinstance(err, CUDAUnavailableError)
    assert _default.peek() is None, "load_pretrained made the default Tier before it checked the checkpoint"
    msg = str(err)
    assert says in msg and str(corrupt) in msg and names in msg, msg
    code, out, text = plan(capsys, str(corrupt), "--budget", "1MB")
    assert_one_line(code, out, text, msg)          # the same refusal, word for word


def test_a_config_alone_that_leaves_sizes_to_defaults_is_planned_with_a_warning(capsys, good, tmp_path):
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(good / "one" / "config.json", d / "config.json")
    _config(d, lambda c: c.pop("hidden_size"))
    code, out, err = plan(capsys, str(d), "--budget", "1GB", "--groups", "0")
    assert code == 0 and "LlamaForCausalLM" in out, err
    assert err.count("\n") == 1 and "warning:" in err and "does not set hidden_size" in err and "hidden_size=4096" in err
    (d / "pytorch_model.bin").write_bytes(b"")
    code, out, err = plan(capsys, str(d), "--budget", "1GB", "--groups", "0")
    assert code == 0 and "holds pytorch_model.bin but no safetensors weights" in err


def test_a_weights_file_given_for_its_folder_is_refused(capsys, good):
    f = good / "one" / "model.safetensors"
    assert_one_line(*plan(capsys, str(f), "--budget", "1MB"), "is a weights file: give the folder that holds it")
    for bad in ("[1, 2]", '{"hidden_size": 64}'):
        cfg = good / "loose.json"
        cfg.write_text(bad)
        assert_one_line(*plan(capsys, str(cfg), "--budget", "1MB"), str(cfg))


def test_a_good_checkpoint_still_plans_and_loads_up_to_the_gpu(capsys, good):
    code, out, err = plan(capsys, str(good / "shards"), "--budget", "100KB")
    assert code == 0 and err == "" and "LlamaForCausalLM (llama)" in out, err
    with pytest.raises(CUDAUnavailableError):        # everything checked, then the GPU is looked for
        tiermem.load_pretrained(good / "one", budget="100KB")


# ---------------------------------------------------------------------------------------------
# The public API: refused before the GPU check, nothing changed

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _state(m: nn.Module) -> list:
    return [(name, t, t.data_ptr(), t.detach().clone()) for name, t in [*m.named_parameters(), *m.named_buffers()]]


def _unchanged(m: nn.Module, before: list) -> None:
    after = dict([*m.named_parameters(), *m.named_buffers()])
    assert len(after) == len(before)
    for name, t, ptr, value in before:
        assert after[name] is t, f"{name} was replaced"
        assert t.data_ptr() == ptr and torch.equal(t.detach(), value) and not hasattr(t, TIERED_ATTR), name
    assert getattr(m, "_tiermem_handle", None) is None


def _llama():
    import transformers
    return transformers.AutoConfig.for_model("llama", **SMALL)


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _quantized() -> torch.Tensor:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)


def _complex32() -> torch.Tensor:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.zeros(4, dtype=torch.complex32)


# (id, call(model, path of a good checkpoint), a part of the message). Each call gets a fresh model.
API_CASES = [
    ("wrap_module budget 150%", lambda m, p: tiermem.wrap_module(m, "150%"), "more than 100%"),
    ("wrap_module budget 0", lambda m, p: tiermem.wrap_module(m, 0), "pass mode='zero_copy' if that is meant"),
    ("wrap_module budget 0%", lambda m, p: tiermem.wrap_module(m, "0%"), "keeps no weight on the device"),
    ("wrap_module budget lots", lambda m, p: tiermem.wrap_module(m, "lots"), "is not a size"),
    ("wrap_module budget -1", lambda m, p: tiermem.wrap_module(m, -1), "must not be negative"),
    ("wrap_module budget True", lambda m, p: tiermem.wrap_module(m, True), "byte count"),
    ("wrap_module budget nan", lambda m, p: tiermem.wrap_module(m, float("nan")), "finite"),
    ("wrap_module mode", lambda m, p: tiermem.wrap_module(m, "1MB", mode="bogus"), "mode must be one of"),
    ("wrap_module lookahead -1", lambda m, p: tiermem.wrap_module(m, "1MB", lookahead=-1), "lookahead must be at least 1"),
    ("wrap_module lookahead 0", lambda m, p: tiermem.wrap_module(m, "1MB", lookahead=0), "at least 1"),
    ("wrap_module lookahead 1.5", lambda m, p: tiermem.wrap_module(m, "1MB", lookahead=1.5), "lookahead must be an int"),
    ("wrap_module zero_copy_max_tokens", lambda m, p: tiermem.wrap_module(m, "1MB", zero_copy_max_tokens=-1),
     "zero_copy_max_tokens must be at least 0"),
    ("wrap_module max_group_bytes", lambda m, p: tiermem.wrap_module(m, "1MB", max_group_bytes=0),
     "max_group_bytes must be at least 1"),
    ("wrap_module weights", lambda m, p: tiermem.wrap_module(m, "1MB", weights=[1]), "weights must be a Mapping"),
    ("wrap_module host_budget", lambda m, p: tiermem.wrap_module(m, "1MB", host_budget="lots"), "is not a size"),
    ("wrap_module disk_reader", lambda m, p: tiermem.wrap_module(m, "1MB", disk_reader="nvme"), "disk_reader must be"),
    ("wrap_module keyword", lambda m, p: tiermem.wrap_module(m, "1MB", lookahed=2),
     "unknown keyword argument 'lookahed'; did you mean 'lookahead'?"),
    ("wrap_module non-module", lambda m, p: tiermem.wrap_module("model", "1MB"), "takes a torch.nn.Module, got str"),
    ("wrap_module tensor", lambda m, p: tiermem.wrap_module(torch.ones(3), "1MB"), "got Tensor"),
    ("wrap_module tier", lambda m, p: tiermem.wrap_module(m, "1MB", tier="gpu0"), "tier must be a tiermem.Tier"),
    ("wrap_module kv_tokens", lambda m, p: tiermem.wrap_module(m, "1MB", kv_budget="auto", kv_tokens=0),
     "kv_tokens must be a number of tokens >= 1"),
    ("wrap_module kv auto", lambda m, p: tiermem.wrap_module(m, "1MB", kv_budget="auto"), "give kv_tokens"),
    ("wrap_module kv_budget", lambda m, p: tiermem.wrap_module(m, "1MB", kv_budget="lots"), "kv_budget='lots'"),
    ("kv_cache max_tokens", lambda m, p: tiermem.kv_cache(_llama(), 0), "max_tokens must be a number of tokens"),
    ("kv_cache keyword", lambda m, p: tiermem.kv_cache(_llama(), 16, slot=2), "did you mean 'slots'?"),
    ("kv_cache kv_budget", lambda m, p: tiermem.kv_cache(_llama(), 16, "lots"), "kv_budget='lots' is not a size"),
    ("wrap_training non-optimizer", lambda m, p: tiermem.wrap_training(m, "adam", "1MB"),
     "takes a torch.optim.Optimizer"),
    ("wrap_training optimizer class", lambda m, p: tiermem.wrap_training(m, torch.optim.SGD, "1MB"),
     "got type"),
    ("wrap_training non-module", lambda m, p: tiermem.wrap_training(None, _sgd(m), "1MB"), "got NoneType"),
    ("wrap_training keyword", lambda m, p: tiermem.wrap_training(m, _sgd(m), "1MB", look_ahead=2),
     "unknown keyword argument 'look_ahead'; did you mean 'lookahead'?"),
    ("wrap_training budget 0", lambda m, p: tiermem.wrap_training(m, _sgd(m), 0), "more than 0 bytes"),
    ("wrap_training recompute", lambda m, p: tiermem.wrap_training(m, _sgd(m), "1MB", recompute="sometimes"),
     "recompute must be one of"),
    ("wrap_training accumulate", lambda m, p: tiermem.wrap_training(m, _sgd(m), "1MB", accumulate=0),
     "accumulate must be at least 1"),
    ("wrap_training link", lambda m, p: tiermem.wrap_training(m, _sgd(m), "1MB", link_GBps=0), "link_GBps must be"),
    ("load_pretrained budget", lambda m, p: tiermem.load_pretrained(p, budget="lots"), "budget='lots' is not a size"),
    ("load_pretrained 150%", lambda m, p: tiermem.load_pretrained(p, budget="150%"), "more than 100%"),
    ("load_pretrained mode", lambda m, p: tiermem.load_pretrained(p, "1MB", mode="fast"), "mode must be one of"),
    ("load_pretrained weights", lambda m, p: tiermem.load_pretrained(p, "1MB", weights={}),
     "load_pretrained() got an unknown keyword argument 'weights'"),
    ("load_pretrained keyword", lambda m, p: tiermem.load_pretrained(p, "1MB", host_budgt="1GB"),
     "did you mean 'host_budget'?"),
    ("load_pretrained host_budget", lambda m, p: tiermem.load_pretrained(p, "1MB", host_budget=-1), "negative"),
    ("load_pretrained dtype", lambda m, p: tiermem.load_pretrained(p, "1MB", dtype="int8"), "not a dtype weights"),
    ("load_pretrained no folder", lambda m, p: tiermem.load_pretrained("/nonexistent/ckpt", "1MB"), "does not exist"),
    ("wrap complex32", lambda m, p: tiermem.wrap(_complex32()), "cannot wrap a complex32 tensor"),
    ("wrap quantized", lambda m, p: tiermem.wrap(_quantized()), "cannot wrap a quantized tensor"),
    ("wrap a list", lambda m, p: tiermem.wrap([1.0, 2.0]), "takes a torch.Tensor"),
    ("wrap parameter role", lambda m, p: tiermem.wrap(m[0].weight, role="weights"), "unknown role 'weights'"),
    ("wrap parameter policy field", lambda m, p: tiermem.wrap(m[0].weight, colour="red"), "unknown policy field"),
    ("unwrap never wrapped", lambda m, p: tiermem.unwrap(m[0].weight), "is not wrapped by tiermem"),
    ("unwrap a number", lambda m, p: tiermem.unwrap(42), "unwrap takes a tensor tiermem wrapped"),
    ("configure keyword", lambda m, p: tiermem.configure(bogus=1), "configure() got an unknown keyword argument"),
    ("configure budget", lambda m, p: tiermem.configure(budget="150%"), "more than 100%"),
    ("prefetch a string", lambda m, p: tiermem.prefetch("x"), "prefetch takes a TieredTensor"),
    ("prefetch a torch tensor", lambda m, p: tiermem.prefetch(m[0].weight), "got Parameter"),
    ("prefetch plain tensors", lambda m, p: tiermem.prefetch(list(m.parameters())), "got Parameter"),
    ("evict a number", lambda m, p: tiermem.evict(42), "evict takes a TieredTensor or an iterable of them, got int"),
    ("evict None in a list", lambda m, p: tiermem.evict([None]), "got NoneType"),
    ("empty shape", lambda m, p: tiermem.empty("abc", role="weight"), "shape must be an int or a sequence of ints"),
    ("empty float shape", lambda m, p: tiermem.empty((2.5, 3), role="weight"), "shape must be"),
    ("empty role", lambda m, p: tiermem.empty(4, role="weights"), "unknown role"),
    ("stats tier", lambda m, p: tiermem.stats(tier="x"), "tier must be a tiermem.Tier"),
    ("allocator role", lambda m, p: tiermem.allocator("bogus"), "unknown role"),
]


@pytest.mark.parametrize("call, message", [(c, msg) for _, c, msg in API_CASES], ids=[i for i, _, _ in API_CASES])
def test_a_bad_argument_raises_its_own_error_before_the_gpu_and_changes_nothing(good, call, message):
    m = _model()
    before = _state(m)
    with pytest.raises(TierMemError) as e:
        call(m, good / "one")
    err = e.value
    assert isinstance(err, (ValueError, TypeError)) and not isinstance(err, CUDAUnavailableError), repr(err)
    assert message in str(err), str(err)
    assert _default.peek() is None, "the default Tier was made before the arguments were checked"
    _unchanged(m, before)


@pytest.mark.parametrize("options, message", [
    (dict(budget="150%"), "more than 100%"), (dict(budget=0), "mode='zero_copy'"), (dict(mode="bogus"), "mode must"),
    (dict(lookahead=-1), "at least 1"), (dict(lookahed=2), "unknown keyword argument 'lookahed'"),
])
def test_a_tier_refuses_the_same_options_and_changes_nothing(tier, fake, options, message):
    m = _model()
    before = _state(m)
    live = fake.live()
    with pytest.raises(TierMemError, match=message):
        tier.wrap_module(m, **options)
    _unchanged(m, before)
    assert fake.live() == live and tier.stats()["resident_bytes.all.current"] == 0


def test_the_sweep_covers_sixty_bad_inputs():
    cli = len(CLI_CASES) + 1 + len(MODEL_CASES) + 2 * len(CORRUPT) + 3
    api = len(API_CASES) + 5
    assert cli + api >= 60 and len(API_CASES) >= 30 and cli >= 30, (cli, api)


# ---------------------------------------------------------------------------------------------
# Through a real process: what a user sees on stderr, and a numpy-only install

def _run(*args: str, hide_torch: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERMEM_", "TRANSFORMERS_VERBOSITY"))}
    env["PYTHONPATH"] = str(ROOT)
    # A numpy-only install (README's CPU-only path): ``import torch`` fails as it does with no
    # torch installed (None in sys.modules: ModuleNotFoundError).
    hide = "import sys; sys.modules['torch'] = None; " if hide_torch else ""
    code = f"{hide}import sys; from tiermem.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_what_a_user_sees_is_one_line(good, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(good / "one", d)
    os.truncate(d / "model.safetensors", 1000)
    for args, fragment in ([str(d)], "(truncated, or not a safetensors file)"), (["nonexistentmodel"], "is not a model type"), \
                          (["t5"], "encoder-decoder"):
        r = _run("plan", *args, "--budget", "1MB")
        assert_one_line(r.returncode, r.stdout, r.stderr, fragment)
        assert len(r.stderr) < 400


def test_without_torch_plan_checks_what_it_can_and_says_torch_is_needed(good, tmp_path):
    r = _run("plan", "llama", *TINY, "--budget", "1MB", hide_torch=True)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "needs torch: pip install torch" in r.stderr, r.stderr
    r = _run("plan", str(good / "one"), "--budget", "1MB", hide_torch=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "checkpoint's 21 tensors" in r.stderr, r.stderr
    d = tmp_path / "trunc"
    shutil.copytree(good / "one", d)
    os.truncate(d / "model.safetensors", 1000)
    for args, fragment in (([str(d)], "truncated"), (["vit"], "not a causal language model"),
                           (["llama", "--link-gbps", "0"], "--link-gbps"), (["lama"], "close: llama")):
        r = _run("plan", *args, "--budget", "1MB", hide_torch=True)
        assert_one_line(r.returncode, r.stdout, r.stderr, fragment)
    r = _run("plan", "--help", hide_torch=True)
    assert r.returncode == 0 and "causal language model" in r.stdout and r.stderr == ""
