"""One rank of the ``cp_attention.hf`` context-parallel tests, started by ``tests/test_hf.py`` with
``python -m torch.distributed.run --nproc-per-node=W``: for every case of ``CASES.json`` (architecture and
CPCache options; ``padded``: false for prompts of one length; ``row``: that prompt alone; ``mode``: a
generation mode of ``_hf_models.MODES``; ``ahead``: through ``decode_ahead``; ``generate``: more ``generate()``
arguments; ``rows``: several query rows on a non-empty cache instead of ``generate``; ``same_positions``: a
prefill (in forwards of ``chunk`` tokens) with the padded mask's position ids on every rank;
``compiled_step``: steps of ``step_rows`` tokens traced whole, :func:`compiled_steps`) it builds the tiny seeded model,
generates with a CPCache over the gloo group and saves ``{case id: (tokens, logits, get_seq_length())}`` to
``OUT_DIR/rank<r>.pt``.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/_hf_worker.py CASES.json OUT_DIR
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import cp_attention.hf as cph  # noqa: E402
from _hf_models import cache_kwarg, forward_rows, generate, prompts, tiny_model  # noqa: E402

DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "bfloat16": torch.bfloat16}


def compiled_steps(model, ids, mask, cache, token_differs: bool, rows: int = 1) -> str:
    """A prefill, then two steps of ``rows`` tokens a row through ``model.forward`` traced whole (what
    transformers compiles: decode steps, or verification steps of drafted tokens): the first feeds the same
    tokens on every rank, the second others on rank 1 when ``token_differs``. The message of the error each
    step raised, or "no error"."""
    step = torch.compile(model.forward, backend="eager", fullgraph=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True).expand(-1, rows)
        for i in range(2):
            mask = torch.cat([mask, torch.ones_like(mask[:, :rows])], 1)
            masks = cph.cp_attention_mask(ids.shape[0], rows, mask.shape[1], mask.shape[1] - rows,
                                          attention_mask=mask.bool())
            fed = (token + 1) % model.config.vocab_size if token_differs and i == 1 else token
            try:
                step(input_ids=fed, attention_mask=masks, position_ids=(mask.cumsum(-1) - 1)[:, -rows:],
                     use_cache=True, **{cache_kwarg(model): cache})
            except RuntimeError as exc:
                return f"step {i}: {exc}"
    return "no error"


def main():
    cases, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results = {}
    try:
        rank = dist.get_rank()
        for case in cases:
            # "rank_differs": what rank 1 changes (a case that every rank must refuse, "expect" its message)
            other = case.get("rank_differs") if rank == 1 else None
            model = tiny_model(case["arch"], seed=1 if other == "weights" else 0,
                               **({"sliding_window": 3} if other == "window" else {}))
            model.set_attn_implementation("cp_attention")
            kwargs = dict(case.get("cache", {}))
            if other == "dtype":
                kwargs["dtype"] = "bfloat16"
            if "dtype" in kwargs:
                kwargs["dtype"] = DTYPES[kwargs["dtype"]]
            cache = cph.CPCache(model.config, **kwargs)
            assert cache.world_size == dist.get_world_size() and cache.rank == rank
            ids, mask = prompts(seed=2 if other == "prompt" else 1, padded=case.get("padded", True) and other != "padding",
                                row=case.get("row"))
            seed = 1 if other == "seed" else 0
            if case.get("same_positions"):  # a prefill, position ids fixed by the padded mask on every rank
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                if other == "mask":  # the same token ids and positions, the padding not masked
                    mask = torch.ones_like(mask)
                elif other == "mask-later":  # prompt 1's first real token masked too (seen at the third chunk)
                    mask = mask.clone()
                    mask[1, int((mask[1] == 0).sum())] = 0
                chunk = case.get("chunk", ids.shape[1])
                try:
                    with torch.no_grad():
                        for c0 in range(0, ids.shape[1], chunk):
                            c1 = c0 + chunk
                            model(input_ids=ids[:, c0:c1], attention_mask=mask[:, :c1],
                                  position_ids=positions[:, c0:c1], use_cache=True, **{cache_kwarg(model): cache})
                    results[case["id"]] = "no error"
                except ValueError as exc:
                    results[case["id"]] = str(exc)
                continue
            if case.get("compiled_step"):
                results[case["id"]] = compiled_steps(model, ids, mask, cache, token_differs=other == "token",
                                                     rows=case.get("step_rows", 1))
                continue
            if "expect" in case:
                try:
                    generate(model, ids, mask, cache, mode=case.get("mode"), ahead=case.get("ahead", False),
                             seed=seed)
                    results[case["id"]] = "no error"
                except ValueError as exc:
                    results[case["id"]] = str(exc)
                continue
            if case.get("rows"):
                tokens, logits = None, forward_rows(model, ids, mask, cache, case["rows"])
            else:
                tokens, logits = generate(model, ids, mask, cache, mode=case.get("mode"),
                                          ahead=case.get("ahead", False), seed=seed, **case.get("generate", {}))
            results[case["id"]] = (tokens, logits, int(cache.get_seq_length()))
        torch.save(results, out_dir / f"rank{dist.get_rank()}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
