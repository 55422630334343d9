"""Hugging Face interop: Llama checkpoints imported and exported, proven against transformers'
LlamaForCausalLM on the same weights; generation with the key/value cache."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.program import sampler
from podtrain.program.load import load_config
from podtrain.train.loop import train
from podtrain.train.run import Run
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# GQA throughout (4 query heads share 2 k/v heads); the variants the issue names.
VARIANTS = {
    "tied": {"tie_word_embeddings": True},
    "untied-theta": {"tie_word_embeddings": False, "rope_theta": 50000.0},
    "llama3-rope": {
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "bfloat16": {"tie_word_embeddings": False, "dtype": "bfloat16"},
}


def hf_llama(folder, seed=0, max_shard_size="5GB", dtype="float32", **options):
    """A random LlamaForCausalLM saved as safetensors in `folder`. Weights are wider than a
    trained model's (initializer_range 0.2), so that greedy choices have clear margins."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **options,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norms start at one; random ones test their mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    # the saved weights in float32, as podtrain's params hold them (rotary tables recomputed in float32)
    return transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def podtrain_logits(run_dir, tokens: np.ndarray) -> np.ndarray:
    _, fns, params = Run.at(run_dir).language_model()
    return np.asarray(fns.apply(params, jnp.asarray(tokens)))


TOKENS = np.random.default_rng(0).integers(0, 300, (2, 40))


@pytest.mark.parametrize("variant", VARIANTS)
def test_import_matches_transformers_and_exports_bitwise(tmp_path, variant, capsys):
    model = hf_llama(tmp_path / "hf", **VARIANTS[variant])
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert np.abs(podtrain_logits(tmp_path / "run", TOKENS) - torch_logits(model, TOKENS)).max() < 1e-4

    dtype = VARIANTS[variant].get("dtype", "float32")
    capsys.readouterr()
    # Without --dtype, the export keeps the dtype the run was imported in, and says which it wrote.
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert f"model.safetensors in {dtype};" in capsys.readouterr().out
    source, exported = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name
    reloaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert np.array_equal(torch_logits(reloaded.float(), TOKENS), torch_logits(model, TOKENS))


def test_a_sharded_checkpoint_imports(tmp_path):
    model = hf_llama(tmp_path / "hf", max_shard_size="100KB")
    assert (
        len(list((tmp_path / "hf").glob("model-*.safetensors"))) >= 2
        and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    )
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert np.abs(podtrain_logits(tmp_path / "run", TOKENS) - torch_logits(model, TOKENS)).max() < 1e-4


def test_trained_model_exports_to_transformers(tmp_path, small_overrides, monkeypatch):
    run = tmp_path / "run"
    train(
        load_config(
            None,
            [
                *small_overrides,
                f"run_dir={run}",
                "model.tie_embeddings=false",
                "train.steps=3",
                "train.eval_every=0",
                "train.eval_batches=1",
                "train.sample_tokens=0",
            ],
        )
    )
    monkeypatch.setattr("podtrain.interop.hf.checkpoint.SHARD_BYTES", 40_000)  # shards and an index, as above 5 GB
    assert main(["convert", "--to-hf", str(run), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert (
        len(list((tmp_path / "out").glob("model-0000?-of-0000?.safetensors"))) > 1
        and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    )
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    tokens = TOKENS[:, :32] % 256
    assert np.abs(podtrain_logits(run, tokens) - torch_logits(model.float().eval(), tokens)).max() < 1e-4


def test_greedy_generation_equals_transformers(tmp_path):
    model = hf_llama(tmp_path / "hf", **VARIANTS["untied-theta"])
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    prompt = TOKENS[0, :7]
    with torch.no_grad():
        theirs = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=32, do_sample=False, min_new_tokens=0)[
            0, 7:
        ].tolist()
    cfg, fns, params = Run.at(tmp_path / "run").language_model()
    assert sampler.generate(fns, params, [prompt.tolist()], 32, max_len=cfg.model.max_seq_len)[0].tokens == theirs


def test_an_imported_model_generates_and_exports_with_its_own_tokenizer(tmp_path, capsys):
    from podtrain.data.tokenizer import fit_bpe

    model = hf_llama(tmp_path / "hf")
    tokenizer = fit_bpe(
        ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30], 300, tmp_path / "hf"
    )
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert (
        main(["generate", str(tmp_path / "run"), "--prompt", "hello world", "--greedy", "--max-new-tokens", "12"]) == 0
    )
    prompt = tokenizer.encode("hello world")
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert capsys.readouterr().out == "hello world" + tokenizer.decode(theirs) + "\n"
    assert main(["convert", "--to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("hello world")["input_ids"] == prompt


@pytest.mark.parametrize("sliding", [0, 6])
def test_sampling_with_the_cache_draws_what_full_passes_draw(small_overrides, sliding):
    """Temperature sampling with the key/value cache draws the same tokens as full forward passes over
    the sequence so far with the same keys (same logits). With every layer sliding over 6 positions
    the cache is a ring of 6 slots, which a padded prefill and 24 steps wrap round several times."""
    cfg = load_config(None, [*small_overrides, f"model.sliding_window={sliding}"])
    from podtrain.program.state import model_fns
    from podtrain.runtime.mesh import build_mesh

    fns = model_fns(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    params = fns.init(jax.random.key(0))
    assert fns.module(params).init_cache(1, 32)[0].shape[2] == (sliding or 32)
    drawn = sampler.generate(fns, params, [[5, 6, 7]], 24, sampler.Sampling(0.8), seeds=[1], max_len=32)[0].tokens
    # the sequence so far padded on the right to all 32 positions (causal: the padding is not seen), one compile
    full = jax.jit(lambda params, tokens: fns.apply(params, tokens[None])[0])
    tokens, key = np.zeros(32, np.int32), jax.random.key(1)
    tokens[:3] = [5, 6, 7]
    for i in range(24):
        logits = full(params, tokens)[2 + i]
        tokens[3 + i] = int(jax.random.categorical(jax.random.fold_in(key, i), logits / 0.8))
    assert drawn == tokens[3:27].tolist()


def test_sampling_draws_only_the_tokenizers_tokens_from_a_larger_vocabulary(small_overrides):
    """A model whose vocabulary is padded past its tokenizer's (llama_1b: 32,000 logits over 256
    bytes) samples only tokens the tokenizer can decode."""
    from podtrain.data.tokenizer import ByteTokenizer
    from podtrain.program.state import model_fns
    from podtrain.runtime.mesh import build_mesh

    cfg = load_config(None, [*small_overrides, "model.vocab_size=4096"])
    fns = model_fns(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    params = fns.init(jax.random.key(0))
    warm = sampler.Sampling(1.0)
    assert max(sampler.generate(fns, params, [[5, 6, 7]], 28, warm, max_len=32)[0].tokens) >= 256  # unrestricted
    assert max(sampler.generate(fns, params, [[5, 6, 7]], 28, warm, vocab=256, max_len=32)[0].tokens) < 256
    assert len(sampler.complete(fns, params, ByteTokenizer(), ["The "], 28, sampler.Sampling(0.8), max_len=32)[0]) > 0


def test_init_from_a_hf_checkpoint_and_a_run_trains_from_those_weights(tmp_path):
    hf_llama(tmp_path / "hf", **VARIANTS["tied"])
    assert (
        main(
            [
                "convert",
                "--from-hf",
                str(tmp_path / "hf"),
                str(tmp_path / "run"),
                "train.seq_len=32",
                "train.batch_size=8",
                "device_type=cpu",
            ]
        )
        == 0
    )
    common = [
        "data.source=text",
        "data.format=text",  # the imported config's is chat
        f"data.path={tmp_path / 'corpus.txt'}",
        "train.steps=2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "train.lr=1e-9",
    ]
    (tmp_path / "corpus.txt").write_text("hello world, " * 400)
    first = {}
    for source in (str(tmp_path / "hf"), str(tmp_path / "run")):
        run = tmp_path / f"ft{len(first)}"
        last = train(
            load_config(tmp_path / "run" / "config.yaml", [*common, f"run_dir={run}", f"train.init_from={source}"])
        )
        first[source] = last["loss"]
    # the same weights from either source, not a random start's
    assert first[str(tmp_path / "hf")] == pytest.approx(first[str(tmp_path / "run")], abs=1e-5)
    scratch = train(load_config(tmp_path / "run" / "config.yaml", [*common, f"run_dir={tmp_path / 'scratch'}"]))
    assert abs(scratch["loss"] - first[str(tmp_path / "run")]) > 0.1
    # the converted run itself trains from its step-0 weights, with a fresh optimizer
    last = train(load_config(tmp_path / "run" / "config.yaml", common))
    assert last["loss"] == pytest.approx(first[str(tmp_path / "run")], abs=1e-5)


def _bad_convert(tmp_path, capsys, *args):
    assert main(["convert", *args]) == 2
    return capsys.readouterr().err


def test_bad_sources_are_refused_naming_the_problem(tmp_path, capsys):
    folder = tmp_path / "hf"
    hf_llama(folder)
    config = json.loads((folder / "config.json").read_text())

    (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    assert "holds a `falcon` model; podtrain converts model_type llama, mistral" in _bad_convert(
        tmp_path, capsys, "--from-hf", str(folder), str(tmp_path / "a")
    )
    (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert "hidden_act='gelu'" in _bad_convert(tmp_path, capsys, "--from-hf", str(folder), str(tmp_path / "b"))
    # a field podtrain does not know may change the computation: refused by name, never dropped
    (folder / "config.json").write_text(json.dumps({**config, "logit_scale": 0.5}))
    assert "config.json has logit_scale, which podtrain does not read for model_type llama" in _bad_convert(
        tmp_path, capsys, "--from-hf", str(folder), str(tmp_path / "b")
    )

    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    err = _bad_convert(tmp_path, capsys, "--from-hf", str(folder), str(tmp_path / "c"))
    assert "no *.safetensors" in err and "pickles, which podtrain never loads" in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_init_from_a_checkpoint_of_other_sizes_names_the_keys(tmp_path, small_overrides, capsys):
    hf_llama(tmp_path / "hf")
    assert (
        main(
            [
                "train",
                *small_overrides,
                f"run_dir={tmp_path / 'run'}",
                f"train.init_from={tmp_path / 'hf'}",
                "model.vocab_size=300",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "is a model of other sizes or options: model.d_model (64 there, 32 here)" in err
        and "model.tie_embeddings (False there, True here)" in err
    )
    assert not list((tmp_path / "run" / "checkpoints").glob("[0-9]*"))


def test_hub_names_load_through_the_hub_cache_and_unreachable_ones_are_errors(tmp_path):
    """In a fresh process offline (huggingface_hub reads HF_HUB_OFFLINE when imported): a model
    in the hub cache converts through the same download call, an unknown name is a clean error."""
    model = hf_llama(tmp_path / "hf")
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "home" / "hub" / "models--someone--tiny-llama"
    shutil.copytree(tmp_path / "hf", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}

    def convert(name, run):
        return subprocess.run(
            [sys.executable, "-m", "podtrain", "convert", "--from-hf", name, str(tmp_path / run)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert convert("someone/tiny-llama", "run").returncode == 0
    assert np.abs(podtrain_logits(tmp_path / "run", TOKENS) - torch_logits(model, TOKENS)).max() < 1e-4
    refused = convert("nobody/no-such-model", "other")
    assert (
        refused.returncode == 2
        and "Could not get the model `nobody/no-such-model` from the Hugging Face hub" in refused.stderr
        and "Traceback" not in refused.stderr
    )
