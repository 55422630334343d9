"""lm-evaluation-harness as podtrain's evaluator: `PodtrainLM`, lm-eval's model interface over a
language model's functions and weights on their mesh, the tasks' names and data checked, and `Tasks`,
which scores eval.tasks during training. `podtrain eval RUN --tasks` (tools/harness.py) scores a
checkpoint with the same adapter.

PodtrainLM is lm-eval's TemplateLM (the LM that owns the text -> tokens step), so contexts and
continuations are split into tokens by lm-eval's own code, as its `hf` model splits them, and each
request is scored as that model scores it: at most max_seq_len tokens in, the oldest cut, an empty
context replaced by the prefix token, documents in lm-eval's rolling windows. Requests go to the
batched sampler `batch_size` at a time, longest first (lm-eval's Collator, as the hf model sorts
them), and come back in their own order. tests/test_harness.py holds the scores to the hf model's
on the run's float32 export.

Departures from the hf model: generation stops at the tokenizer's stop tokens (EOS) or after
max_gen_toks, and the text is then cut at the first `until` string (the hf model also stops the
batch once every row has written one: the same text, more steps); no one-token-continuation logits
cache (the same numbers); texts are encoded as podtrain's tokenizer encodes them, without the
special tokens a Hugging Face tokenizer's post-processor may add (a BOS); one process.
"""

from __future__ import annotations

import difflib
import functools

from podtrain.data.chat import stop_ids
from podtrain.errors import ConfigError, first_line
from podtrain.program import sampler
from podtrain.program.tasks.registry import require_language

try:  # the optional extra `eval`: imported by `podtrain eval --tasks` and by training with eval.tasks
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as e:
    raise ConfigError(
        f"lm-evaluation-harness tasks need lm-eval, which is not installed here ({e}): pip install 'podtrain[eval]'."
    ) from None

MAX_GEN_TOKS = 256  # of a task that names none, as lm-eval's hf model


class PodtrainLM(TemplateLM):
    """lm-eval's `LM` over a podtrain language model: (cfg, fns, params) as `Run.language_model`
    gives them, and the run's tokenizer."""

    def __init__(self, cfg, fns, params, tokenizer, batch_size: int = 8):
        super().__init__()
        self.fns, self.params, self.tokenizer, self.batch_size = fns, params, tokenizer, batch_size
        self.max_length = cfg.model.max_seq_len

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a document's first window start from, as the hf model starts from
        its tokenizer's BOS: the run's generation_config.json's bos_token_id (which the export keeps),
        else the EOS; a newline for bytes."""
        bos = self.tokenizer.generation.get("bos_token_id", self.eot_token_id)
        return bos if bos is not None else self.tokenizer.encode("\n")[0]

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(key, context tokens, continuation tokens) -> (log p(continuation | context), greedy)."""
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results = []
        for chunk in order.get_batched(n=self.batch_size):
            # max_length positions in, and the last token only a target: max_length + 1 tokens
            sequences = [(context + continuation)[-(self.max_length + 1) :] for _, context, continuation in chunk]
            scored = sampler.score(self.fns, self.params, sequences, max_len=self.max_length)
            for (_, _, continuation), s in zip(chunk, scored, strict=True):
                n = len(continuation)
                results.append((float(s.logprobs[-n:].sum()), bool(s.greedy[-n:].all())))
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, every token scored once, in windows of max_length."""
        windows, counts = [], []
        for (text,) in (r.args for r in requests):
            rolling = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1)
            pairs = [make_disjoint_window(w) for w in rolling]
            windows += [(None, *pair) for pair in pairs]
            counts.append(len(pairs))
        scores, totals = iter(self._loglikelihood_tokens(windows)), []
        for n in counts:
            totals.append(sum(next(scores)[0] for _ in range(n)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless its gen_kwargs sample) and cut at its first `until` string."""
        eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        # (context, gen_kwargs, seed, task): a request's seed is its place, whatever batch it lands in
        items = [(*r.args, i, r.task_name) for i, r in enumerate(requests)]
        order = Collator(
            items, sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]), group_by="gen_kwargs", group_fn=lambda r: r[1]
        )
        texts = []
        for chunk in order.get_batched(n=self.batch_size):
            contexts, gen_kwargs, seeds, tasks = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(gen_kwargs[0], MAX_GEN_TOKS)
            until, new = handle_stop_sequences(kwargs.pop("until", None), eos=eos), kwargs.pop("max_gen_toks")
            if not 0 < new < self.max_length:
                raise ConfigError(
                    f"Task {tasks[0]} generates up to max_gen_toks={new} tokens, which leaves no room for its prompt "
                    f"in this model's {self.max_length} positions (model.max_seq_len); evaluate a model with a longer "
                    "context, or copy the task's YAML with a smaller max_gen_toks into --include-path."
                )
            sampling = sampler.Sampling(
                temperature=float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0,
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            done = sampler.generate(
                self.fns,
                self.params,
                [self.tok_encode(c) or [self.prefix_token_id] for c in contexts],
                new,
                sampling,
                stop=stop_ids(self.tokenizer),
                seeds=seeds,
                vocab=self.tokenizer.vocab_size,
                max_len=self.max_length,
            )
            texts += [postprocess_generated_text(self.tokenizer.decode(c.tokens), until, None) for c in done]
        return order.get_original(texts)


@functools.cache
def task_manager(include_path: str | None) -> TaskManager:
    """lm-eval's tasks and those of the YAML files under `include_path`, indexed once per process
    (reading lm-eval's thousands of task files takes seconds)."""
    return TaskManager(include_path=include_path)


def check_names(tasks: list[str], manager: TaskManager, flag: str = "--tasks") -> None:
    """Every task, group or tag is one lm-eval knows, or the names it knows that come closest."""
    known = set(manager.all_tasks)
    if unknown := [t for t in tasks if t not in known]:
        guesses = [
            f"{t!r} (close: {', '.join(close)})"
            if (close := difflib.get_close_matches(t, manager.all_tasks))
            else repr(t)
            for t in unknown
        ]
        where = f"lm-eval's and {manager.include_path}'s" if manager.include_path else "lm-eval's"
        raise ConfigError(
            f"{flag}: none of {where} {len(known):,} tasks, groups and tags is called {'; '.join(guesses)}. "
            "`lm-eval ls tasks` lists them; a task of your own is a YAML file in a folder given as --include-path."
        )


def load_tasks(tasks: list[str], manager: TaskManager, flag: str = "--tasks") -> list:
    """lm-eval's task (or group) objects with their data, read before any weights; a task whose data
    cannot be read (a hub dataset offline, a data file missing) named with what to do."""
    loaded = []
    for name in tasks:
        try:
            found = manager.load([name])
        except OSError as e:  # datasets' FileNotFoundError, the hub's ConnectionError and HTTP errors
            raise ConfigError(
                f"{flag} {name}: its data could not be read: {first_line(e)}. A hub dataset is downloaded once "
                "into HF_HOME's datasets cache: run once where huggingface.co is reachable, without "
                "HF_DATASETS_OFFLINE=1. A local task's data_files are read relative to the directory podtrain runs "
                "in: check the paths in its YAML."
            ) from None
        group = found["groups"].get(name)
        loaded += [group] if group is not None else list(found["tasks"].values())
    return loaded


def scores(results: dict) -> dict[str, float]:
    """lm-eval's results as metrics: eval/TASK/METRIC (METRIC_FILTER where a task filters its answers),
    of every task and group."""
    flat = {}
    for task, metrics in {**results.get("results", {}), **results.get("groups", {})}.items():
        for name, value in metrics.items():
            metric, _, kind = name.partition(",")
            if kind and isinstance(value, int | float) and not metric.endswith("_stderr"):
                flat[f"eval/{task}/{metric}" + ("" if kind == "none" else f"_{kind}")] = float(value)
    return flat


class Tasks:
    """A training run's eval.tasks: named and their data read when it starts (a typo or a dataset
    out of reach stops it before the first step), scored on the weights as they are on the training
    mesh at each eval.every."""

    def __init__(self, cfg, tokenizer):
        after = "Leave eval.tasks empty: train.eval_every scores its held-out puzzles."
        require_language(cfg.model, f"{cfg.run_dir} trains", f"eval.tasks={cfg.eval.tasks} scores", after)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.manager = task_manager(cfg.eval.include_path or None)
        check_names(cfg.eval.tasks, self.manager, "eval.tasks")
        load_tasks(cfg.eval.tasks, self.manager, "eval.tasks")

    def scores(self, fns, params) -> dict[str, float]:
        e = self.cfg.eval
        results = lm_eval.simple_evaluate(
            model=PodtrainLM(self.cfg, fns, params, self.tokenizer, e.batch_size),
            tasks=load_tasks(e.tasks, self.manager, "eval.tasks"),
            limit=e.limit or None,
            num_fewshot=e.num_fewshot,
            task_manager=self.manager,
        )
        return scores(results)
