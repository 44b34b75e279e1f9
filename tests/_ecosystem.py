"""accelerate's FSDP2 plugin and the transformers Trainer driving fsdp_compose
and torch's FSDP2 on the same script (tests/test_ecosystem.py; ``python -m
tests._ecosystem`` prints the table of docs/ecosystem.md).

accelerate 1.15 on CPU keeps ``DistributedType.MULTI_CPU`` (and wraps in DDP)
even with an FSDP plugin; both implementations are put on its FSDP2 path the
same way (the distributed type set to FSDP after the Accelerator is made) and
each run checks that it took it (``accelerator.is_fsdp2`` and the prepared
model an ``FSDPModule``). ``fsdp_compose.use_as_fsdp2()`` is the only other
difference between the two.
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

STEPS_BEFORE, STEPS_AFTER = 3, 2


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    # intermediate 130: rows that do not split evenly over 2 or 4 ranks
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=130, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (2, 16), generator=g)


def _accelerator(impl: str):
    import fsdp_compose
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    if impl == "ours":
        fsdp_compose.use_as_fsdp2()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    # (see the module doc) the same for both implementations
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def run(rank: int, world: int, root: str, impl: str, load_from: str | None) -> dict:
    """Train STEPS_BEFORE steps, ``save_state``, train on (the uninterrupted
    run); a second model ``load_state``s (our own checkpoint, or
    ``load_from``'s) and trains the same steps."""
    from torch.distributed.fsdp import FSDPModule
    acc = _accelerator(impl)
    out = {"is_fsdp2": acc.is_fsdp2}

    def make():
        m = tiny_llama()
        return acc.prepare(m, torch.optim.AdamW(m.parameters(), lr=1e-2))

    def train(m, o, steps):
        losses = []
        for s in steps:
            ids = _batch(s, rank)
            loss = m(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        return losses

    def full(m):  # accelerator.get_state_dict: full tensors on rank 0 (save_pretrained's)
        sd = acc.get_state_dict(m)
        return {k: v.clone() for k, v in sd.items()}

    m, o = make()
    out["fsdp_module"] = isinstance(m, FSDPModule)
    out["class_from"] = type(m).__mro__[1].__module__
    out["before"] = train(m, o, range(STEPS_BEFORE))
    acc.save_state(os.path.join(root, impl))
    out["full_at_save"] = full(m)
    out["uninterrupted"] = train(m, o, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    out["full_after"] = full(m)

    m2, o2 = make()
    acc._models, acc._optimizers = acc._models[-1:], acc._optimizers[-1:]  # load into m2 only
    acc.load_state(os.path.join(root, load_from or impl))
    out["full_loaded"] = full(m2)
    out["resumed"] = train(m2, o2, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    out["full_resumed"] = full(m2)
    # the classes FSDP2's code checks for (ours: RowParam, a DTensor subclass)
    from torch.distributed.tensor import DTensor

    def kind(v):
        return "DTensor" if isinstance(v, DTensor) else type(v).__name__
    out["state_types"] = sorted({kind(v) for v in m2.state_dict().values()})
    out["optim_types"] = sorted({kind(v) for st in o2.state_dict()["state"].values()
                                 for v in st.values()})
    out["state_classes"] = sorted({type(v).__name__ for v in m2.state_dict().values()})
    return out


def trainer_run(rank: int, world: int, root: str, impl: str, sd_type: str) -> dict:
    """The transformers Trainer (fsdp_config version 2, ``sd_type`` checkpoints):
    4 steps saving at step 2, then a new Trainer (another init) resumes from
    checkpoint-2 and runs steps 3-4."""
    import transformers
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from transformers import Trainer, TrainingArguments

    import fsdp_compose
    if impl == "ours":
        fsdp_compose.use_as_fsdp2()
    real = transformers.trainer.Accelerator

    def accelerator(*a, **k):  # (see the module doc) the same for both implementations
        acc = real(*a, **k)
        acc.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        acc.state.fsdp_plugin = k["fsdp_plugin"]
        return acc
    transformers.trainer.Accelerator = accelerator
    g = torch.Generator().manual_seed(5)
    data = []
    for _ in range(32):
        ids = torch.randint(0, 128, (16,), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    out_dir = os.path.join(root, f"trainer_{impl}_{sd_type}")
    args = dict(output_dir=out_dir, per_device_train_batch_size=2, max_steps=4, save_steps=2,
                save_strategy="steps", learning_rate=1e-2, use_cpu=True, fsdp=True,
                fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                             "state_dict_type": sd_type},
                report_to=[], logging_steps=1, seed=0, data_seed=0,
                lr_scheduler_type="constant", disable_tqdm=True)

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h]
    t = Trainer(model=tiny_llama(0), args=TrainingArguments(**args), train_dataset=data)
    t.train()
    out = {"fsdp2_path": t.is_fsdp_enabled and t.accelerator.is_fsdp2,
           "class_from": type(t.model_wrapped).__mro__[1].__module__,
           "losses": losses(t), "full": t.accelerator.get_state_dict(t.model_wrapped),
           "grad_norms": [float(h["grad_norm"]) for h in t.state.log_history
                          if "grad_norm" in h]}
    t2 = Trainer(model=tiny_llama(1), args=TrainingArguments(**args), train_dataset=data)
    t2.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    out["resumed"] = losses(t2)[-2:]
    out["full_resumed"] = t2.accelerator.get_state_dict(t2.model_wrapped)
    return out


def launches(world: int = 2) -> dict:
    """Every run of the table, in one temporary folder: FSDP2, ours (resuming
    from its own checkpoint), ours from FSDP2's, FSDP2 from ours."""
    from ._dist import run_distributed
    with tempfile.TemporaryDirectory(prefix="fsdp_eco_") as root:
        out = {"fsdp2": run_distributed(run, world, root, "fsdp2", None, timeout=300)}
        out["ours"] = run_distributed(run, world, root, "ours", None, timeout=300)
        out["ours_from_fsdp2"] = run_distributed(run, world, root, "ours", "fsdp2", timeout=300)
        out["fsdp2_from_ours"] = run_distributed(run, world, root, "fsdp2", "ours", timeout=300)
        for sd_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            for impl in ("fsdp2", "ours"):
                out[f"trainer_{impl}_{sd_type}"] = run_distributed(
                    trainer_run, world, root, impl, sd_type, timeout=300)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def table(out: dict) -> str:
    """Stack × operation × result, ours and FSDP2 (from one call of ``launches``)."""
    ours, f2 = out["ours"][0], out["fsdp2"][0]

    def mark(ok: bool) -> str:
        return "bit-exact" if ok else "DIFFERS"
    rows = [
        ("train 3 steps (losses)", "= FSDP2's" if ours["before"] == f2["before"] else "DIFFERS",
         "reference"),
        ("`save_state` + `load_state`, then 2 steps",
         mark(_same(ours["full_loaded"], ours["full_at_save"])
              and ours["resumed"] == ours["uninterrupted"]
              and _same(ours["full_resumed"], ours["full_after"])),
         mark(_same(f2["full_loaded"], f2["full_at_save"]) and f2["resumed"] == f2["uninterrupted"]
              and _same(f2["full_resumed"], f2["full_after"]))),
        ("`get_state_dict` (full, rank 0)", "= FSDP2's" if _same(ours["full_at_save"],
                                                               f2["full_at_save"]) else "DIFFERS",
         "reference"),
        ("`load_state` of the other's checkpoint, then 2 steps",
         mark(_same(out["ours_from_fsdp2"][0]["full_loaded"], f2["full_at_save"])
              and out["ours_from_fsdp2"][0]["resumed"] == f2["uninterrupted"]),
         mark(_same(out["fsdp2_from_ours"][0]["full_loaded"], ours["full_at_save"])
              and out["fsdp2_from_ours"][0]["resumed"] == ours["uninterrupted"])),
        ("`model.state_dict()` / `optimizer.state_dict()` values",
         "/".join(ours["state_types"]) + "; " + "/".join(ours["optim_types"]),
         "/".join(f2["state_types"]) + "; " + "/".join(f2["optim_types"])),
    ]
    for sd_type in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        t_ours, t_f2 = out[f"trainer_ours_{sd_type}"][0], out[f"trainer_fsdp2_{sd_type}"][0]
        rows.append((f"Trainer (fsdp_config version 2, {sd_type}): 4 steps",
                     "losses = FSDP2's" if t_ours["losses"] == t_f2["losses"] else "DIFFERS",
                     "reference"))
        rows.append((f"Trainer `resume_from_checkpoint` ({sd_type}), steps 3-4",
                     mark(t_ours["resumed"] == t_ours["losses"][-2:]
                          and _same(t_ours["full_resumed"], t_ours["full"])),
                     mark(t_f2["resumed"] == t_f2["losses"][-2:]
                          and _same(t_f2["full_resumed"], t_f2["full"]))))
    lines = ["| accelerate 1.15 / transformers 5.24, FSDP2 path, 2 gloo ranks | fsdp_compose "
             "| torch FSDP2 |",
             "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(table(launches()))
