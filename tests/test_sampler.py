"""The batched sampler (podtrain.program.sampler): prompts of mixed lengths decoded together equal
each decoded alone and transformers' generate; rows stop at their own stop tokens; a sharded mesh
samples what one device samples; top-k and top-p draw only from the tokens they allow; a seed
gives the same draws in any batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from podtrain.cli import main
from podtrain.config.parallel import MeshConfig
from podtrain.program import sampler
from podtrain.program.load import load_config
from podtrain.program.state import model_fns
from podtrain.runtime.mesh import build_mesh
from podtrain.train.run import Run

from test_hf import TOKENS, VARIANTS, hf_llama

torch = pytest.importorskip("torch")

PROMPTS = [[5, 6, 7], [9], list(range(40, 60)), [3, 1, 4, 1, 5, 9, 2]]


def small(small_overrides, mesh: MeshConfig | None = None, devices: int = 1, *extra):
    """A small random model's functions and params on `devices` (a mesh of them)."""
    cfg = load_config(None, [*small_overrides, *extra])
    fns = model_fns(cfg, build_mesh(mesh or cfg.mesh, jax.devices()[:devices]))
    return fns, fns.init(jax.random.key(0))


def test_a_batch_of_mixed_lengths_equals_each_prompt_alone_and_transformers(tmp_path):
    model = hf_llama(tmp_path / "hf", **VARIANTS["untied-theta"])
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    cfg, fns, params = Run.at(tmp_path / "run").language_model()
    prompts = [TOKENS[i % 2, i : 3 + 5 * i].tolist() for i in range(4)]
    batched = sampler.generate(fns, params, prompts, 20, max_len=cfg.model.max_seq_len)
    for prompt, together in zip(prompts, batched):
        alone = sampler.generate(fns, params, [prompt], 20, max_len=cfg.model.max_seq_len)[0]
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=0)
        assert together.tokens == alone.tokens == theirs[0, len(prompt) :].tolist()
        np.testing.assert_allclose(together.logprobs, alone.logprobs, atol=1e-5)
        with torch.no_grad():  # each token's log-probability, as transformers scores the whole sequence
            logits = model(theirs).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, theirs[0, len(prompt) :, None])[:, 0].numpy()
        np.testing.assert_allclose(together.logprobs, expected, atol=1e-4)


def test_each_row_stops_at_its_own_stop_token(small_overrides):
    fns, params = small(small_overrides)
    free = sampler.generate(fns, params, PROMPTS, 12, max_len=32)
    stop = {free[0].tokens[2], free[2].tokens[5]}  # row 0 stops at its third token at the latest
    ended = sampler.generate(fns, params, PROMPTS, 12, stop=sorted(stop), max_len=32)
    for unstopped, row in zip(free, ended):
        first = next((i for i, t in enumerate(unstopped.tokens) if t in stop), None)
        assert row.stopped == (first is not None)
        assert row.tokens == unstopped.tokens[: 12 if first is None else first]
    assert ended[0].stopped and len(ended[0].tokens) <= 2


def test_a_sharded_mesh_samples_what_one_device_samples(small_overrides):
    """data x fsdp x tensor over 8 devices: the params split, the rows over data and fsdp."""
    one = small(small_overrides)
    eight = small(small_overrides, MeshConfig(data=2, fsdp=2, tensor=2), 8)
    warm = sampler.Sampling(0.9, top_k=20)
    for sampling in (sampler.Sampling(), warm):
        a, b = (sampler.generate(*m, PROMPTS, 10, sampling, max_len=32) for m in (one, eight))
        assert [r.tokens for r in a] == [r.tokens for r in b]
        np.testing.assert_allclose([r.logprobs for r in a], [r.logprobs for r in b], atol=1e-5)


def test_a_generation_is_one_program_with_the_tokens_in_a_loop_and_the_params_kept_sharded(small_overrides):
    """The mechanism, read off the compiled program: one while loop of decode steps (no host round
    trip per token), and the params taken as the mesh shards them (fsdp x tensor), never gathered whole
    into one device's copy."""
    fns, params = small(small_overrides, MeshConfig(data=2, fsdp=2, tensor=2), 8)
    program = sampler._decoder(sampler.Same(fns.graphdef), fns.mesh, 10, 32, sampler.Sampling(), (), None)
    tokens, lengths, seeds = np.zeros((8, 16), np.int32), np.ones(8, np.int32), np.arange(8, dtype=np.uint32)
    compiled = program.lower(params, tokens, lengths, seeds).compile()
    assert compiled.as_text().count(" while(") >= 1
    given = jax.tree.leaves(compiled.input_shardings[0][0])
    held = [leaf.sharding for leaf in jax.tree.leaves(params)]
    assert all(g.is_equivalent_to(h, leaf.ndim) for g, h, leaf in zip(given, held, jax.tree.leaves(params)))
    assert any(not h.is_fully_replicated for h in held)  # the mesh does split them


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.3)])
def test_top_k_and_top_p_draw_only_the_tokens_they_allow(small_overrides, top_k, top_p):
    fns, params = small(small_overrides)
    prompt = [5, 6, 7]
    logits = np.asarray(fns.apply(params, jnp.asarray([prompt], jnp.int32))[0, -1], np.float64)
    ranked = np.argsort(-logits)
    probs = np.exp(logits[ranked] - logits.max())
    probs /= probs.sum()
    allowed = (
        set(ranked[:top_k].tolist()) if top_k else set(ranked[: np.searchsorted(np.cumsum(probs), top_p) + 1].tolist())
    )
    rows = sampler.generate(fns, params, [prompt] * 64, 1, sampler.Sampling(1.0, top_k, top_p), max_len=32)
    drawn = {r.tokens[0] for r in rows}
    assert drawn <= allowed and len(drawn) > 1


def test_a_seed_draws_the_same_in_any_batch(small_overrides):
    fns, params = small(small_overrides)
    warm = sampler.Sampling(1.0)
    batch = sampler.generate(fns, params, PROMPTS, 10, warm, seeds=[11, 12, 13, 14], max_len=32)
    assert [r.tokens for r in batch] == [
        r.tokens for r in sampler.generate(fns, params, PROMPTS, 10, warm, seeds=[11, 12, 13, 14], max_len=32)
    ]
    alone = sampler.generate(fns, params, [PROMPTS[2]], 10, warm, seeds=[13], max_len=32)[0]
    assert alone.tokens == batch[2].tokens
    other = sampler.generate(fns, params, PROMPTS, 10, warm, seeds=[21, 22, 23, 24], max_len=32)
    assert [r.tokens for r in other] != [r.tokens for r in batch]


def test_score_gives_the_log_probabilities_the_sampler_drew_with(small_overrides):
    fns, params = small(small_overrides)
    rows = sampler.generate(fns, params, PROMPTS, 8, max_len=32)
    scored = sampler.score(fns, params, [p + r.tokens for p, r in zip(PROMPTS, rows)], max_len=32)
    for prompt, row, s in zip(PROMPTS, rows, scored):
        np.testing.assert_allclose(s.logprobs[len(prompt) - 1 :], row.logprobs, atol=1e-5)
        assert s.greedy[len(prompt) - 1 :].all()  # greedy tokens are the argmax


def test_generate_prompts_writes_one_completion_per_row_and_refuses_rows_without_a_prompt(tmp_path, capsys):
    import json

    hf_llama(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(
        "".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(["ab", "hello there", "x"]))
    )
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompts", str(rows), "--greedy", "--max-new-tokens", "5"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["id"] for p in printed] == [0, 1, 2] and all(isinstance(p["completion"], str) for p in printed)
    alone = main(["generate", str(tmp_path / "run"), "--prompt", "hello there", "--greedy", "--max-new-tokens", "5"])
    assert alone == 0 and capsys.readouterr().out == "hello there" + printed[1]["completion"] + "\n"
    assert main(["generate", str(tmp_path / "run"), "--prompts", str(tmp_path / "absent.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    rows.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    assert main(["generate", str(tmp_path / "run"), "--prompts", str(rows)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and '"prompt"' in err and "Traceback" not in err
