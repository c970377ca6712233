"""The free benchmark swept over whole model libraries (issue 34, point 7): every architecture
that can be built tiny, trained 2 steps in fp32, bf16 (model cast) and bf16 autocast under
``FreeBench(pert_mode="combined")``, forward and backward stage, each probed run checked
bit-identical (losses, parameters, global RNG state) to an unprobed run of the same model.

    python benchmarks/bench_sweep.py plan   --results DIR --library timm|transformers
    python benchmarks/bench_sweep.py run    --results DIR --library L [--shard 0/2] [--timeout 900]
    python benchmarks/bench_sweep.py report --results DIR [--md sweep.md] [--results-md RESULTS.md]
    python benchmarks/bench_sweep.py all    --results DIR [--shards 2] [--python-timm PY]

What is swept (``plan``, written once to ``DIR/plan-<library>.json`` and reused):

* timm: ``timm.list_models()`` grouped by the module that registers each model (one family per
  architecture module); per module the candidates are its models by parameter count (counted on
  the meta device), the smallest first; the first one that builds with ``pretrained=False``,
  4 classes, and trains a plain step at the smallest input of 64, 96, 128, 224 px is the
  family's model. A candidate above 20 M parameters is tried first with ``depth=2`` where its
  constructor takes it (the ViT-like modules).
* transformers: every model type with a head among causal LM, masked LM, seq2seq LM, image,
  audio and text classification, CTC and speech seq2seq (the first in that order), built from
  its config class with widths, layer counts, heads, vocabulary and image sizes overridden small
  (``shrink``), random init, nothing downloaded; one above 5 M parameters after shrinking is
  not run.

Each family is one item: a result file ``DIR/<library>/<family>.json`` written whole or not at
all; ``run`` skips the items that have one (resume), runs its shard (``--shard i/n``: the plan's
items ``i::n``) in a worker process it restarts when the worker dies, and gives each item
``--timeout`` seconds (in-process alarm; the driver kills a worker stuck past it). What could not
be built or run is a result too, with the step that failed and the exception's type and message.
``report`` aggregates: rows per family, dtype and stage; each row the float64 verdict the probe
computed (``cause``); rows of the known genuine PyTorch CPU defects (``KNOWN``) apart from the
rest; the failures; markdown for ``benchmarks/RESULTS.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

LIBRARIES = ("timm", "transformers")
SETTINGS = ("fp32", "bf16", "autocast")     # tests/_hf_models.ZOO_DTYPES
STAGES = ("forward", "backward")
STEPS = 2
BATCH = 2
SEQ = 16
VOCAB = 256
IMAGE_SIZES = (64, 96, 128, 224)
#: timm candidates tried per module (the smallest first)
TIMM_CANDIDATES = 4
#: timm candidates above this many parameters are tried with ``TIMM_SHRINK`` first
TIMM_BIG = 20_000_000
TIMM_SHRINK = {"depth": 2}
#: transformers models above this many parameters after ``shrink`` are not run
HF_MAX_PARAMS = 5_000_000
#: transformers heads, in order of preference: (task, auto-mapping name)
HF_TASKS = (("lm", "CAUSAL_LM"), ("lm", "MASKED_LM"), ("seq2seq", "SEQ_TO_SEQ_CAUSAL_LM"),
            ("image", "IMAGE_CLASSIFICATION"), ("audio", "AUDIO_CLASSIFICATION"),
            ("text_cls", "SEQUENCE_CLASSIFICATION"), ("ctc", "CTC"),
            ("speech_seq2seq", "SPEECH_SEQ_2_SEQ"))

#: the known genuine defects of PyTorch's CPU kernels (issue 34 "Measured" 7, docs/
#: free_benchmark.md, benchmarks/RESULTS.md): a row is one of them when its API is listed, the
#: run computed in bf16 (bf16 weights or autocast), the stage matches and the float64 analysis
#: found the kernel inaccurate (cause ``inaccurate``: the kernel against float64 on the call's
#: inputs, whichever step's check flagged the call)
KNOWN = (
    ("bf16 layer_norm backward", ("Functional.layer_norm", "Torch.layer_norm"), ("backward",)),
    ("bf16 batch_norm backward", ("Functional.batch_norm", "Torch.batch_norm"), ("backward",)),
    # (the all-bf16 CPU norms keep their mean and rstd in bf16: docs, "Saved statistics")
    ("bf16 group_norm backward", ("Functional.group_norm", "Torch.group_norm"), ("backward",)),
    ("bf16 GRU/LSTM backward", ("Torch.gru", "Torch.lstm"), ("backward",)),
    ("bf16 embedding_bag backward", ("Functional.embedding_bag", "Torch.embedding_bag"),
     ("backward",)),
    ("bf16 broadcast mul backward", ("Tensor.__mul__", "Tensor.__rmul__", "Tensor.__imul__",
                                     "Torch.mul", "Tensor.mul", "Tensor.mul_"), ("backward",)),
    ("bf16 cross_entropy/nll_loss mean", ("Functional.cross_entropy", "Functional.nll_loss"),
     ("forward", "backward")),
    ("bf16 grid_sample", ("Functional.grid_sample", "Torch.grid_sampler"),
     ("forward", "backward")),
)

log = logging.getLogger("bench_sweep")


# -- enumeration ---------------------------------------------------------------------------------

def group_by_module(model_to_module: dict, params: dict, candidates: int = TIMM_CANDIDATES
                    ) -> list[dict]:
    """timm's models grouped by the module that registers each: one item per module, its
    candidates the module's models by parameter count (``params[name]``; ``None``: could not be
    counted, tried last in name order), smallest first, at most ``candidates``."""
    mods: dict[str, list] = {}
    for name, mod in model_to_module.items():
        mods.setdefault(mod.rsplit(".", 1)[-1], []).append(name)
    items = []
    for mod in sorted(mods):
        names = sorted(mods[mod], key=lambda n: (params.get(n) is None, params.get(n) or 0, n))
        items.append({"id": f"timm.{mod}", "library": "timm", "family": mod,
                      "candidates": [[n, params.get(n)] for n in names[:candidates]],
                      "models": len(names)})
    return items


def heads_by_type(mappings: dict) -> list[dict]:
    """One item per transformers model type: its first head in ``HF_TASKS`` order.
    ``mappings``: ``{mapping name: {model type: class name or tuple of names}}``."""
    chosen: dict[str, dict] = {}
    for task, mapping in HF_TASKS:
        for mtype, cls in mappings.get(mapping, {}).items():
            if mtype in chosen:
                continue
            cls = cls[0] if isinstance(cls, (tuple, list)) else cls
            chosen[mtype] = {"id": f"transformers.{mtype}", "library": "transformers",
                             "family": mtype, "task": task, "cls": cls}
    return [chosen[t] for t in sorted(chosen)]


def shard(items: list, index: int, count: int) -> list:
    """Items ``index::count`` of the plan sorted by id: every item in exactly one shard."""
    if not 0 <= index < count:
        raise ValueError(f"shard: {index}/{count} is not valid; accepted: i/n with 0 <= i < n")
    return sorted(items, key=lambda it: it["id"])[index::count]


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard: {text!r} is not valid; accepted: i/n, e.g. 0/2") from None
    shard([], i, n)
    return i, n


def timm_plan() -> list[dict]:
    import timm
    import torch
    from timm.models import _registry

    params = {}
    for name in timm.list_models():
        try:
            with torch.device("meta"):
                m = timm.create_model(name, pretrained=False, num_classes=4)
            params[name] = sum(p.numel() for p in m.parameters())
        except Exception:    # a model whose __init__ computes with values: counted when built
            params[name] = None
    return group_by_module(_registry._model_to_module, params)


def transformers_plan() -> list[dict]:
    from transformers.models.auto import modeling_auto

    maps = {m: dict(getattr(modeling_auto, f"MODEL_FOR_{m}_MAPPING_NAMES"))
            for _, m in HF_TASKS}
    return heads_by_type(maps)


def plan(results: str, library: str) -> list[dict]:
    """The library's items, from ``DIR/plan-<library>.json`` when it exists (resume)."""
    path = os.path.join(results, f"plan-{library}.json")
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)["items"]
    items = timm_plan() if library == "timm" else transformers_plan()
    os.makedirs(results, exist_ok=True)
    write_json(path, {"library": library, "versions": versions(), "items": items})
    return items


# -- files ---------------------------------------------------------------------------------------

def write_json(path: str, obj) -> None:
    from probekit.atomic import atomic_write

    atomic_write(path, json.dumps(obj, indent=1, default=str), fsync=False)


def safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def result_path(results: str, item: dict) -> str:
    return os.path.join(results, item["library"], safe(item["family"]) + ".json")


def pending(results: str, items: list) -> list:
    """The items without a result file."""
    return [it for it in items if not os.path.exists(result_path(results, it))]


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "python": sys.version.split()[0],
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for lib in LIBRARIES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[lib] = importlib.metadata.version(lib)
    return out


# -- models and batches --------------------------------------------------------------------------

def _classifier(net):
    """A timm model behind zoo_train's interface: ``model(pixel_values=, labels=).loss``."""
    import torch
    from _hf_models import _Output

    class Classifier(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, pixel_values, labels):
            out = self.net(pixel_values)
            if isinstance(out, (tuple, list)):   # distilled heads in training mode
                out = out[0]
            return _Output(torch.nn.functional.cross_entropy(out, labels))

    return Classifier(net)


def _plain_step(model, batch) -> None:
    """One fp32 forward and backward, no probe: does the model train at this input?"""
    import torch

    gen = torch.Generator().manual_seed(0)
    model(**batch(None, gen)).loss.backward()


def image_batch(size: int, channels: int = 3, classes: int = 4):
    import torch

    def batch(kind, gen):
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=gen),
                "labels": torch.randint(0, classes, (BATCH,), generator=gen)}
    return batch


def timm_spec(item: dict) -> tuple[dict, list]:
    """The first candidate of a timm module that builds and trains a plain fp32 step: ``{"model",
    "kwargs", "size", "params"}``, and the failed attempts ``[{"model", "error"}]``."""
    import torch

    attempts = []
    for name, n in item["candidates"]:
        import timm

        shrinks = [TIMM_SHRINK, {}] if (n or 0) > TIMM_BIG else [{}]
        last = None
        for size in IMAGE_SIZES:
            for kw in [{**s, **i} for i in ({"img_size": size}, {}) for s in shrinks]:
                torch.manual_seed(0)
                try:
                    net = timm.create_model(name, pretrained=False, num_classes=4, **kw)
                    model = _classifier(net).train()
                    _plain_step(model, image_batch(size))
                except Exception as exc:
                    last = f"{type(exc).__name__}: {exc}"
                    continue
                return ({"model": name, "kwargs": kw, "size": size,
                         "params": sum(p.numel() for p in model.parameters())}, attempts)
        attempts.append({"model": name, "error": (last or "")[:500]})
    raise BuildError("no candidate builds and trains a plain fp32 step at "
                     f"{'/'.join(map(str, IMAGE_SIZES))} px: " +
                     "; ".join(f"{a['model']}: {a['error'][:200]}" for a in attempts))


class BuildError(Exception):
    pass


#: config keys set small by ``shrink`` (where the config has them with an int value above)
_WIDTH = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "embedding_size",
          "d_embed", "word_embed_proj_dim", "projection_dim", "dim", "text_embed_dim",
          "vision_embed_dim", "proj_dim", "encoder_hidden_size", "decoder_hidden_size",
          "hidden_dim_model")
_FFN = ("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "ffn_dim",
        "n_inner", "hidden_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
        "intermediate_size_mlp", "d_inner", "expert_intermediate_size", "ffn_hidden_size",
        "mlp_dim", "dim_feedforward", "encoder_intermediate_size", "decoder_intermediate_size",
        "linear_units")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
          "decoder_attention_heads", "n_heads", "attention_heads", "num_attention_head")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num",
             "n_kv_heads", "num_key_value_groups")
_HEAD_DIM = ("head_dim", "d_kv", "d_head", "attention_head_dim", "kv_channels",
             "qk_nope_head_dim", "v_head_dim", "attention_head_size")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
           "num_decoder_layers", "n_layers", "num_encoder_layers", "encoder_num_layers",
           "decoder_num_layers", "num_hidden_layers_per_block")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
              "max_sequence_length", "max_target_positions", "max_text_positions")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")
_LIST_WIDTH = ("hidden_sizes", "embed_dims", "embed_dim", "hidden_size", "dims", "widths",
               "neck_hidden_sizes", "channels")
_LIST_DEPTH = ("depths", "layers", "num_layers", "block_repeats", "num_blocks")
_LIST_HEADS = ("num_heads", "num_attention_heads", "heads")
SMALL = {"width": 64, "ffn": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 2,
         "vocab": VOCAB, "positions": 128, "experts": 4, "topk": 2, "image": 64,
         "mel_positions": 32}


def shrink(cfg: dict, vocab: int = VOCAB) -> dict:
    """The overrides that make a transformers config (its ``to_dict()``) small: widths 64,
    feed-forward 128, 4 heads (2 key/value heads), head dim 16, 2 layers, vocabulary ``vocab``
    (token ids moved inside it), 128 positions, 4 experts (2 per token), 64 px images; per-stage
    lists keep their length: widths 16·2^i, depth 1, heads 2^i. Sub-configs (dicts) likewise."""
    out: dict = {}
    for key, val in cfg.items():
        new = _shrunk(key, val, cfg, vocab)
        if new is not _KEEP and new != val:
            out[key] = new
    for key in _LAYERS:   # per-layer lists (layer_types...) follow the layer count
        n, m = cfg.get(key), out.get(key)
        if not isinstance(n, int) or m is None:
            continue
        for k, v in cfg.items():
            if isinstance(v, (list, tuple)) and len(v) == n and k not in out:
                keep = _representative(v, m)
                out[k] = [v[i] for i in keep]
                out[key] = max(out[key], len(keep))
    return out


def _representative(values, m: int) -> list:
    """Indices of ``m`` entries of a per-layer list that keep each distinct entry once (the
    first of each, then the first others), in order."""
    first, seen = [], []
    for i, v in enumerate(values):
        if v not in seen:
            seen.append(v)
            first.append(i)
    rest = [i for i in range(len(values)) if i not in first]
    return sorted(first + rest[:max(0, m - len(first))])


_KEEP = object()


def _shrunk(key, val, cfg, vocab):
    small = SMALL
    if isinstance(val, dict):
        sub = shrink(val, vocab)
        return {**val, **sub} if sub else _KEEP
    if isinstance(val, bool) or val is None:
        return _KEEP
    if isinstance(val, int):
        if key in _WIDTH:
            return min(val, small["width"])
        if key in _FFN:
            return min(val, small["ffn"])
        if key in _HEADS:
            return min(val, small["heads"])
        if key in _KV_HEADS:
            return min(val, small["kv_heads"])
        if key in _HEAD_DIM:
            return min(val, small["head_dim"])
        if key == "rotary_dim":
            return min(val, small["head_dim"])
        if key == "qk_rope_head_dim":
            return min(val, small["head_dim"] // 2)
        if key in ("kv_lora_rank", "q_lora_rank"):
            return min(val, 2 * small["head_dim"])
        if key in _LAYERS:
            return min(val, small["layers"])
        if key in ("vocab_size", "n_vocab"):
            return min(val, vocab)
        if key.endswith("token_id") or key.endswith("token_index") or key == "padding_idx":
            return val if val < 3 else val % 3   # special ids inside the small vocabulary
        if key in _POSITIONS:
            return min(val, small["positions"])
        if key in ("max_source_positions",):
            return min(val, small["mel_positions"])
        if key in _EXPERTS:
            return min(val, small["experts"])
        if key in _TOPK:
            return min(val, small["topk"])
        if key == "image_size":
            return min(val, small["image"])
        return _KEEP
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in val):
        if key in ("image_size",):
            return [min(v, small["image"]) for v in val]
        if key.endswith("token_id"):
            return [v if v < 3 else v % 3 for v in val]
        if key in _LIST_WIDTH:
            return [min(v, 16 * 2 ** i) for i, v in enumerate(val)]
        if key == "conv_dim":   # a speech model's feature extractor
            return [min(v, 32) for v in val]
        if key in _LIST_DEPTH:
            return [1] * len(val)
        if key in _LIST_HEADS:
            return [min(v, 2 ** i) for i, v in enumerate(val)]
    return _KEEP


def hf_batch(task: str, cfg):
    """The batch function of a transformers model for its task (labels included)."""
    import torch

    def get(name, default):
        for c in (cfg, getattr(cfg, "vision_config", None), getattr(cfg, "audio_config", None)):
            v = getattr(c, name, None) if c is not None else None
            if v is not None:
                return v
        return default

    vocab = min(get("vocab_size", VOCAB) or VOCAB, VOCAB)

    def ids(gen, n):
        return torch.randint(3, vocab, (BATCH, n), generator=gen)

    def batch(kind, gen):
        if task == "lm":
            x = ids(gen, SEQ)
            return {"input_ids": x, "labels": x}
        if task == "seq2seq":
            return {"input_ids": ids(gen, SEQ), "labels": ids(gen, SEQ // 2)}
        if task == "text_cls":
            return {"input_ids": ids(gen, SEQ),
                    "labels": torch.randint(0, 4, (BATCH,), generator=gen)}
        if task == "image":
            size = get("image_size", SMALL["image"])
            size = size[0] if isinstance(size, (list, tuple)) else size
            return {"pixel_values": torch.randn(BATCH, get("num_channels", 3), size, size,
                                                generator=gen),
                    "labels": torch.randint(0, 4, (BATCH,), generator=gen)}
        if task in ("audio", "ctc"):
            labels = (torch.randint(0, 4, (BATCH,), generator=gen) if task == "audio"
                      else ids(gen, 4))
            mels = get("num_mel_bins", None)
            if mels is not None:   # spectrogram models: (batch, frames, mel bins)
                return {"input_values": torch.randn(BATCH, 64, mels, generator=gen),
                        "labels": labels}
            # raw audio: 4000 samples, 12 frames after a wav2vec2-style front (stride 320),
            # more than the 10 frames a SpecAugment time mask spans
            return {"input_values": torch.randn(BATCH, 4000, generator=gen), "labels": labels}
        if task == "speech_seq2seq":
            mels = get("num_mel_bins", 80)
            frames = 2 * get("max_source_positions", SMALL["mel_positions"])
            return {"input_features": torch.randn(BATCH, mels, frames, generator=gen),
                    "labels": ids(gen, SEQ // 2)}
        raise ValueError(f"task: {task!r} is not valid; accepted: "
                         f"{', '.join(sorted({t for t, _ in HF_TASKS}))}")
    return batch


def hf_spec(item: dict) -> tuple[dict, list]:
    """The shrunk config of a transformers model type: ``{"model", "overrides", "params"}``."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg_cls = transformers.CONFIG_MAPPING[item["family"]]
    defaults = cfg_cls().to_dict()
    overrides = shrink(defaults)
    if item["task"] in ("image", "audio", "text_cls"):
        overrides["num_labels"] = 4
    for key, val in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if defaults.get(key) is None:   # left None by some configs; a padded batch needs one
            overrides[key] = val
    if "seq2seq" in item["task"] and defaults.get("decoder_start_token_id") is None:
        overrides["decoder_start_token_id"] = 1
    cfg = cfg_cls(**overrides)
    cls = getattr(transformers, item["cls"])
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > HF_MAX_PARAMS:
        raise BuildError(f"{n / 1e6:.1f} M parameters after shrinking (limit "
                         f"{HF_MAX_PARAMS / 1e6:g} M): a config key the rules do not know")
    return {"model": item["cls"], "overrides": overrides, "params": n}, []


def _seed() -> None:
    """Seed every generator a model may draw from: torch's, and numpy's and Python's (the
    SpecAugment masks of HuBERT and Data2Vec-Audio in training are drawn with ``np.random``), so
    the unprobed and the probed run of a model see the same draws."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


def factory(item: dict, spec: dict):
    """``(make(setting) -> fresh model in training mode, seeded; batch(kind, gen))``."""
    if item["library"] == "timm":
        import timm

        def make(setting):
            _seed()
            net = timm.create_model(spec["model"], pretrained=False, num_classes=4,
                                    **spec["kwargs"])
            return _cast(_classifier(net).train(), setting)
        return make, image_batch(spec["size"])
    import transformers

    cfg_cls = transformers.CONFIG_MAPPING[item["family"]]
    cls = getattr(transformers, item["cls"])

    def make(setting):
        _seed()
        return _cast(cls(cfg_cls(**spec["overrides"])).train(), setting)
    return make, hf_batch(item["task"], cfg_cls(**spec["overrides"]))


def _cast(model, setting):
    import torch

    if setting not in SETTINGS:
        raise ValueError(f"setting: {setting!r} is not valid; accepted: {', '.join(SETTINGS)}")
    return model.to(torch.bfloat16) if setting == "bf16" else model


# -- one item ------------------------------------------------------------------------------------

class ItemTimeout(Exception):
    pass


def _error(where: str, exc: BaseException) -> dict:
    return {"where": where, "type": type(exc).__name__, "message": str(exc)[:1000],
            "traceback": "".join(traceback.format_exception(exc)[-3:])[-1500:]}


def run_item(item: dict, steps: int = STEPS) -> dict:
    """Build the family's model, then per setting an unprobed run and one probed run per
    stage (combined mode), each compared with the unprobed one bit for bit."""
    import torch
    from _hf_models import zoo_train
    from bench_zoo_unseen import _record, identity_of

    import probekit

    t0 = time.perf_counter()
    rec = {"id": item["id"], "library": item["library"], "family": item["family"],
           "versions": versions(), "status": "ok", "configs": [], "settings": {}}
    try:
        spec, attempts = (timm_spec if item["library"] == "timm" else hf_spec)(item)
        make, batch = factory(item, spec)
    except ItemTimeout:
        raise
    except Exception as exc:
        rec.update(status="failed", error=_error("build", exc),
                   seconds=time.perf_counter() - t0)
        return rec
    rec.update(spec=spec, attempts=attempts, task=item.get("task", "image"))
    kind = item["family"]
    with tempfile.TemporaryDirectory() as tmp:
        for setting in SETTINGS:
            t1 = time.perf_counter()
            try:   # the unprobed run: can the model train in this setting at all?
                ref_model = make(setting)
                ref_losses = zoo_train(ref_model, kind, setting, steps=steps, batch=batch)
                ref = (ref_model, ref_losses, torch.get_rng_state())
            except ItemTimeout:
                raise
            except Exception as exc:
                rec["settings"][setting] = {"error": _error("unprobed run", exc)}
                continue
            rec["settings"][setting] = {"losses": ref_losses,
                                        "seconds": time.perf_counter() - t1}
            for stage in STAGES:
                t2 = time.perf_counter()
                dump = os.path.join(tmp, f"{setting}_{stage}")
                model = make(setting)
                fb = probekit.FreeBench(dump_path=dump, pert_mode="combined", fuzz_stage=stage)
                try:
                    losses = zoo_train(model, kind, setting, steps=steps, probe=fb, batch=batch)
                except ItemTimeout:
                    raise
                except Exception as exc:   # the probe made a training that runs without it fail
                    rec["configs"].append({"dtype": setting, "stage": stage,
                                           "mode": "combined",
                                           "error": _error("probed run", exc)})
                    continue
                r = _record(kind, setting, "combined", stage, False, fb)
                r["identity"] = identity_of(ref, (model, losses, torch.get_rng_state()), fb)
                r["seconds"] = time.perf_counter() - t2
                rec["configs"].append(r)
    if all("error" in v for v in rec["settings"].values()):   # it trains in no setting
        rec.update(status="failed", error=next(iter(rec["settings"].values()))["error"])
    rec["seconds"] = time.perf_counter() - t0
    return rec


# -- driver and worker ---------------------------------------------------------------------------

def _alarm(signum, frame):
    raise ItemTimeout("per-model timeout")


def select(items: list, only: str | None) -> list:
    """The items whose id is in the comma-separated ``only`` (all when empty)."""
    if not only:
        return items
    ids = set(only.split(","))
    return [it for it in items if it["id"] in ids]


def work(results: str, library: str, index: int, count: int, timeout: int,
         only: str | None = None) -> int:
    """Run this shard's pending items one after the other; exit 3 after a timeout (the
    interpreter may hold a half-run model: the driver starts a fresh worker)."""
    import torch

    torch.set_num_threads(1)
    logging.getLogger("probekit").setLevel(logging.ERROR)
    items = pending(results, shard(select(plan(results, library), only), index, count))
    os.makedirs(os.path.join(results, library), exist_ok=True)
    signal.signal(signal.SIGALRM, _alarm)
    for item in items:
        path = result_path(results, item)
        if os.path.exists(path):
            continue
        write_json(path + ".started", {"pid": os.getpid(), "time": time.time()})
        t0 = time.perf_counter()
        signal.alarm(timeout)
        timed_out = False
        try:
            rec = run_item(item)
        except ItemTimeout as exc:
            timed_out = True
            rec = {"id": item["id"], "library": library, "family": item["family"],
                   "status": "failed", "error": {**_error("timeout", exc),
                                                 "message": f"over {timeout} s"}}
        except Exception as exc:   # a failure of the harness itself, recorded all the same
            rec = {"id": item["id"], "library": library, "family": item["family"],
                   "status": "failed", "error": _error("harness", exc)}
        finally:
            signal.alarm(0)
        rec.setdefault("seconds", time.perf_counter() - t0)
        write_json(path, rec)
        os.remove(path + ".started")
        print(f"{item['id']}: {summary_line(rec)}", file=sys.stderr, flush=True)
        if timed_out:
            return 3
    return 0


def drive(results: str, library: str, index: int, count: int, timeout: int,
          python: str = sys.executable, only: str | None = None) -> int:
    """Run the shard in worker processes until every item has a result: a worker that dies (a
    crash, or stuck in a kernel past the timeout + 60 s) leaves a failure record for its item."""
    items = shard(select(plan(results, library), only), index, count)
    folder = os.path.join(results, library)
    os.makedirs(folder, exist_ok=True)
    for it in items:   # markers of an interrupted sweep: those items are run again
        with contextlib.suppress(FileNotFoundError):
            os.remove(result_path(results, it) + ".started")
    while pending(results, items):
        cmd = [python, os.path.abspath(__file__), "run", "--worker", "--results", results,
               "--library", library, "--shard", f"{index}/{count}", "--timeout", str(timeout)]
        if only:
            cmd += ["--only", only]
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": ROOT})
        killed = False
        while proc.poll() is None:
            time.sleep(2)
            for it in items:
                marker = result_path(results, it) + ".started"
                with contextlib.suppress(OSError, ValueError):
                    with open(marker) as fh:
                        started = json.load(fh)["time"]
                    if time.time() - started > timeout + 60:
                        proc.kill()
                        killed = True
        rc = proc.wait()
        for it in items:
            marker = result_path(results, it) + ".started"
            if os.path.exists(marker):
                why = (f"killed after {timeout + 60} s (stuck past the timeout)" if killed
                       else f"the worker died (exit status {rc})")
                write_json(result_path(results, it),
                           {"id": it["id"], "library": library, "family": it["family"],
                            "status": "failed",
                            "error": {"where": "crash", "type": "WorkerDied", "message": why}})
                os.remove(marker)
        if rc not in (0, 3) and not killed and not any(
                os.path.exists(result_path(results, it)) for it in items):
            raise RuntimeError(f"the {library} worker fails before its first item "
                               f"(exit status {rc})")
    return 0


def summary_line(rec: dict) -> str:
    if rec.get("status") != "ok":
        e = rec.get("error", {})
        return f"FAILED ({e.get('where')}: {e.get('type')}: {str(e.get('message'))[:160]})"
    rows = sum(c.get("rows", 0) for c in rec["configs"])
    other = sum(1 for x in rows_of([rec]) if x["category"] != "known")
    ident = all(_identical(c) for c in rec["configs"] if "identity" in c)
    errs = [c for c in rec["configs"] if "error" in c] + [
        s for s in rec["settings"].values() if "error" in s]
    return (f"{rec['spec']['model']} {rec['spec']['params'] / 1e6:.2f}M: {rows} rows "
            f"({other} not known), identity {'ok' if ident else 'BROKEN'}, "
            f"{len(errs)} errors, {rec.get('seconds', 0):.0f} s")


def _identical(c: dict) -> bool:
    i = c["identity"]
    return i["losses_equal"] and not i["params_differing"] and i["rng_equal"]


# -- report --------------------------------------------------------------------------------------

def known_class(row: dict, setting: str, stage: str):
    """The name of the known genuine defect a finding row is (``KNOWN``), else None."""
    if setting == "fp32" or row.get("cause") != "inaccurate":
        return None
    api = row["api_name"].rsplit(".", 2)[0]
    for name, apis, stages in KNOWN:
        if api in apis and stage in stages:
            return name
    return None


#: the rows outside ``KNOWN`` analysed one class at a time (benchmarks/sweep_classes.md: each
#: class with a standalone repro and its float64 numbers). ``category``: ``genuine`` (a kernel
#: defect not in KNOWN), ``false`` (a probekit verdict or coverage defect), ``model`` (the
#: computation is ill-conditioned as the sweep sized the model: a fix to the model). ``match``:
#: the row fields a row of the class has, each a tuple of the accepted values (absent: any).
#: Matched before ``KNOWN`` (a family's rows of another mechanism on a listed API)
_KINKS = ("Functional.hardswish", "Functional.relu6", "Functional.hardtanh",
          "Functional.hardsigmoid", "Functional.leaky_relu", "Torch.clamp", "Tensor.clamp",
          "Torch.abs", "Tensor.abs")
_BF16 = ("bf16", "autocast")
ANALYSED = (
    {"id": "A", "category": "false", "label": "autocast's cached cast of a parameter that "
     "several calls use (probekit defect A)",
     "match": {"family": ("coat", "albert", "neomme", "pegasus_x", "sew-d", "t5gemma2",
                          "prophetnet", "hrm_text"),
               "setting": ("autocast",),
               "stage": ("backward",),
               "api": ("Functional.linear", "Torch.conv2d")}},
    {"id": "K", "category": "false", "label": "a piecewise function's kink crossed by the "
     "bit_noise nudge (backward)",
     "match": {"api": _KINKS, "stage": ("backward",), "pert_mode": ("bit_noise",),
               "cause": ("ill-conditioned",)}},
    {"id": "I", "category": "false", "label": "resampling: fp32 source coordinates' rounding "
     "(u |x_src| |dy/dx_src|) outside the bound",
     "match": {"api": ("Functional.interpolate",), "setting": ("fp32", "autocast"),
               "stage": ("forward",), "cause": ("inaccurate",)}},
    {"id": "N", "category": "genuine", "label": "a norm over one element (LayerNorm(1)): "
     "exact 0 (the bias), the vectorised kernels' fused fold gives u |x| rstd (pytorch#5410's "
     "mechanism; the scalar kernel is exact)",
     "match": {"family": ("csatv2",), "api": ("Functional.layer_norm",)}},
    {"id": "M", "category": "false", "label": "norm statistics far above their spread: the "
     "folded statistics' rounding u rstd (|x| + |mu|) outside S (closed by the fold term)",
     "match": {"two_sample": (True,), "cause": ("inaccurate",), "setting": ("fp32",)}},
    {"id": "M2", "category": "model", "label": "batch-norm statistics over 2 values (batch 2, "
     "1x1 map): x - mean cancels",
     "match": {"two_sample": (True,), "cause": ("ill-conditioned",)}},
    {"id": "M4", "category": "model", "label": "bf16 batch-norm channels whose spread is about "
     "one bf16 ulp of their mean",
     "match": {"family": ("mobilevitv2", "starnet"), "api": ("Functional.batch_norm",),
               "setting": _BF16, "cause": ("ill-conditioned",)}},
    {"id": "M3", "category": "genuine", "label": "bf16 batch_norm forward (training) rounds "
     "the batch mean to bf16 before x - mean",
     "match": {"two_sample": (True,), "cause": ("inaccurate",), "setting": _BF16,
               "stage": ("forward",)}},
    {"id": "U", "category": "false", "label": "subnormal results: the bound has no underflow "
     "floor (softmax of scores 100-500 apart: exp(-100) = 3.7e-44)",
     "match": {"family": ("swin_transformer", "cpmant"), "cause": ("inaccurate",),
               "api": ("Tensor.__matmul__", "Torch.matmul", "Functional.linear",
                       "Functional.softmax", "Tensor.__truediv__")}},
    {"id": "Z", "category": "false", "label": "an exact zero under bit_noise (1 - mask of an "
     "all-ones mask; x - max(x, c) of bit-identical operands; log(1))",
     "match": {"family": ("canine", "funnel", "pegasus_x", "rwkv", "layoutlm", "markuplm",
                          "switch_transformers", "ministral3"),
               "api": ("Tensor.__rsub__", "Tensor.__sub__", "Torch.log"),
               "pert_mode": ("bit_noise",), "cause": ("ill-conditioned",)}},
    {"id": "O", "category": "false", "label": "bit_noise moves a mask's finfo.min past the "
     "finite range: a NaN/Inf mismatch of the perturbation's own making",
     "match": {"pert_mode": ("bit_noise",), "kind": ("nan_inf",), "cause": ("unconfirmed",)}},
    {"id": "O2", "category": "false", "label": "fp32 finfo.min + finfo.min overflows to -inf, "
     "the float64 re-run does not: a NaN/Inf row of the upcast's wider range",
     "match": {"family": ("gpt_neo",), "api": ("Tensor.__add__",), "kind": ("nan_inf",),
               "pert_mode": ("improve_precision",)}},
    {"id": "F", "category": "model", "label": "sinusoidal position embeddings computed in bf16: "
     "sin/cos of arguments whose last bit is worth radians",
     "match": {"family": ("funnel",), "api": ("Torch.sin", "Torch.cos"), "setting": ("bf16",),
               "cause": ("ill-conditioned",)}},
    {"id": "L", "category": "model", "label": "bf16 computations that cancel or amplify by "
     "design: a softmax over scores of +-260 (CPM-Ant), lambda_1 - lambda_2 (DiffLlama)",
     "match": {"family": ("cpmant", "diffllama"), "api": ("Functional.softmax", "Tensor.__sub__"),
               "setting": _BF16, "stage": ("forward",), "pert_mode": ("bit_noise",),
               "cause": ("ill-conditioned",)}},
    {"id": "C", "category": "genuine", "label": "oneDNN bf16 convolution: wrong results for "
     "some shapes (up to 87 % of S)",
     "match": {"api": ("Torch.conv1d", "Torch.conv2d", "Torch.conv3d"), "setting": _BF16,
               "stage": ("forward",), "cause": ("inaccurate",)}},
    {"id": "P", "category": "genuine", "label": "bf16 pooling backward sums in bf16",
     "match": {"api": ("Functional.adaptive_avg_pool2d", "Functional.avg_pool2d",
                       "Functional.adaptive_avg_pool1d", "Functional.avg_pool1d",
                       "Functional.max_pool2d"),
               "setting": _BF16, "stage": ("backward",), "cause": ("inaccurate",)}},
    {"id": "D", "category": "genuine", "label": "bf16 batched GEMM (einsum's bmm path) takes "
     "subnormal bf16 inputs as zero, where torch.mm keeps them",
     "match": {"family": ("falcon_h1",), "api": ("Torch.einsum",), "setting": _BF16,
               "stage": ("backward",), "cause": ("inaccurate",)}},
    {"id": "H", "category": "genuine", "label": "bf16 SDPA backward sums dK/dV over query "
     "blocks in bf16",
     "match": {"api": ("Functional.scaled_dot_product_attention",), "setting": _BF16,
               "stage": ("backward",), "cause": ("inaccurate",)}},
    {"id": "BM", "category": "genuine", "label": "bf16 broadcast matmul backward: per-slice "
     "bf16 products summed over the broadcast dims",
     "match": {"family": ("gemma4_vit",), "api": ("Tensor.__matmul__",), "setting": _BF16,
               "stage": ("backward",), "cause": ("inaccurate",)}},
)


def analysed_class(row: dict):
    """The ``ANALYSED`` class of a flattened row (``rows_of``), else None."""
    for cls in ANALYSED:
        if all(row.get(k) in v for k, v in cls["match"].items()):
            return cls
    return None


def ratio(row: dict) -> float:
    """A row's ratio; pandas writes an infinite one (a NaN/Inf mismatch, a 0 threshold) as
    null."""
    return float("inf") if row.get("ratio") is None else row["ratio"]


def load(results: str) -> list[dict]:
    recs = []
    for lib in LIBRARIES:
        folder = os.path.join(results, lib)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as fh:
                    recs.append(json.load(fh))
    return recs


def rows_of(recs: list[dict]) -> list[dict]:
    """Every finding row, flattened, with its family, setting, stage and class."""
    out = []
    for r in recs:
        for c in r.get("configs", ()):
            for f in c.get("findings", ()):
                row = {"library": r["library"], "family": r["family"],
                       "model": r["spec"]["model"], "setting": c["dtype"], "stage": c["stage"],
                       **f, "api": f["api_name"].rsplit(".", 2)[0]}
                out.append(row)
    two = {(x["family"], x.get("call_site"), _shape(x)[1]) for x in out
           if x["api"] == "Functional.batch_norm" and _two_sample(_shape(x))}
    for x in out:
        shape = _shape(x)
        x["two_sample"] = x["api"] == "Functional.batch_norm" and (_two_sample(shape) or (
            len(shape) == 1 and (x["family"], x.get("call_site"), shape[0]) in two))
        cls = analysed_class(x)
        known = None if cls else known_class(x, x["setting"], x["stage"])
        x.update(known=known, cls=cls["id"] if cls else ("known" if known else "?"),
                 category=cls["category"] if cls else ("known" if known else "unclassified"),
                 label=cls["label"] if cls else (known or "unclassified"))
    return out


def _shape(row: dict) -> tuple:
    """A row's shape (``"(2, 192, 1, 1)"`` in the JSON) as a tuple of ints."""
    return tuple(int(v) for v in re.findall(r"\d+", str(row.get("shape", ""))))


def _two_sample(shape: tuple) -> bool:
    """A batch norm's output or input gradient whose statistics are over 2 values per channel:
    batch 2 and a 1x1 map (or no map)."""
    return len(shape) >= 2 and shape[0] == 2 and all(v == 1 for v in shape[2:])


CATEGORIES = ("known", "genuine", "model", "false", "unclassified")


def render(recs: list[dict], wall: float | None = None) -> str:
    for r in recs:   # results written before run_item marked a model that trains in no setting
        sets = r.get("settings") or {}
        if r.get("status") == "ok" and sets and all("error" in v for v in sets.values()):
            r.update(status="failed", error=next(iter(sets.values()))["error"])
    ok = [r for r in recs if r.get("status") == "ok"]
    failed = [r for r in recs if r.get("status") != "ok"]
    rows = rows_of(recs)
    by_cat = {c: [x for x in rows if x["category"] == c] for c in CATEGORIES}
    heads = [f"{s} {st[:3]}" for s in SETTINGS for st in STAGES]
    lines = [f"{len(recs)} families ({sum(r['library'] == 'timm' for r in recs)} timm modules, "
             f"{sum(r['library'] == 'transformers' for r in recs)} transformers model types): "
             f"{len(ok)} built and trained, {len(failed)} not. "
             f"{len(rows)} finding rows: {len(by_cat['known'])} of the known genuine defects, "
             f"**{len(rows) - len(by_cat['known'])} other**: {len(by_cat['genuine'])} of new "
             f"genuine defects, {len(by_cat['model'])} of computations ill-conditioned as the "
             f"sweep sizes the model, **{len(by_cat['false'])} false** "
             f"(probekit verdict or coverage defects), {len(by_cat['unclassified'])} not "
             f"classified." + (f" Wall time {wall / 3600:.2f} h." if wall else ""), ""]
    ident = [c for r in ok for c in r["configs"] if "identity" in c]
    broken = [(r["family"], c["dtype"], c["stage"]) for r in ok for c in r["configs"]
              if "identity" in c and not _identical(c)]
    cfg_err = [(r["family"], c["dtype"], c["stage"], c["error"]) for r in ok
               for c in r["configs"] if "error" in c]
    set_err = [(r["family"], s, v["error"]) for r in ok for s, v in r["settings"].items()
               if "error" in v]
    lines += [f"Check mode bit-identical (losses, parameters, RNG state) in "
              f"{len(ident) - len(broken)} of {len(ident)} probed runs"
              + (f"; **differs**: {', '.join('/'.join(b) for b in broken)}" if broken else "")
              + f". Probed runs that raised where the unprobed run did not: {len(cfg_err)}. "
              f"Settings the model cannot train in without the probe: {len(set_err)}.", ""]
    lines += ["Rows per family (cells: finding rows, the known defects' in brackets; `other`: "
              "rows that are not a known defect, `unclassified`: of those, the ones no class "
              "below explains):", "",
              "| library | family | model | params | " + " | ".join(heads) +
              " | other | unclassified | checked | identity |",
              "|---|---|---|---:|" + "---:|" * len(heads) + "---:|---:|---:|---|"]
    for r in ok:
        mine = [x for x in rows if x["family"] == r["family"] and x["library"] == r["library"]]
        cells = []
        for s in SETTINGS:
            for st in STAGES:
                c = next((c for c in r["configs"] if c["dtype"] == s and c["stage"] == st),
                         None)
                if c is None:
                    cells.append("n/a")
                elif "error" in c:
                    cells.append("error")
                else:
                    k = sum(1 for x in mine if x["setting"] == s and x["stage"] == st
                            and x["category"] == "known")
                    cells.append(f"{c['rows']}" + (f" [{k}]" if k else ""))
        n_other = sum(1 for x in mine if x["category"] != "known")
        n_unc = sum(1 for x in mine if x["category"] == "unclassified")
        checked = sum(c.get("checked", 0) for c in r["configs"])
        ids = [c for c in r["configs"] if "identity" in c]
        lines.append(f"| {r['library']} | {r['family']} | {r['spec']['model']} | "
                     f"{r['spec']['params'] / 1e6:.2f}M | " + " | ".join(cells) +
                     f" | {n_other} | {'**' + str(n_unc) + '**' if n_unc else 0} | {checked} | "
                     f"{sum(_identical(c) for c in ids)}/{len(ids)} |")
    lines += ["", "Rows by class (`benchmarks/sweep_classes.md` has each class's repro):", "",
              "| class | category | what | API | dtype | stage | pert_mode | kind | cause | rows | "
              "families | worst × |", "|---|---|---|---|---|---|---|---|---|---:|---|---:|"]
    groups: dict = {}
    for x in rows:
        key = (CATEGORIES.index(x["category"]), x["cls"], x["label"], x["api"], x["setting"],
               x["stage"], x.get("pert_mode"), x.get("kind"), x.get("cause"))
        groups.setdefault(key, []).append(x)
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
        g = groups[key]
        fams = sorted({x["family"] for x in g})
        more = f" +{len(fams) - 6}" if len(fams) > 6 else ""
        lines.append(f"| {key[1]} | {CATEGORIES[key[0]]} | {key[2]} | `{key[3]}` | {key[4]} | "
                     f"{key[5]} | {key[6]} | {key[7]} | {key[8]} | {len(g)} | "
                     f"{', '.join(fams[:6])}{more} | {max(ratio(x) for x in g):.3g} |")
    lines += ["", "Not built or not run (the step that failed, the exception):", "",
              "| library | family | where | error |", "|---|---|---|---|"]
    for r in failed:
        e = r.get("error", {})
        msg = " ".join(str(e.get("message", "")).split())[:220].replace("|", "\\|")
        lines.append(f"| {r['library']} | {r['family']} | {e.get('where')} | "
                     f"{e.get('type')}: {msg} |")
    for fam, s, e in set_err:
        msg = " ".join(str(e.get("message", "")).split())[:220].replace("|", "\\|")
        lines.append(f"| | {fam} ({s} only) | {e['where']} | {e['type']}: {msg} |")
    for fam, s, st, e in cfg_err:
        msg = " ".join(str(e.get("message", "")).split())[:220].replace("|", "\\|")
        lines.append(f"| | {fam} ({s} {st}, probed only) | {e['where']} | {e['type']}: {msg} |")
    return "\n".join(lines)


def report(results: str, md: str | None = None, wall: float | None = None,
           only: str | None = None) -> str:
    recs = select(load(results), only)
    text = render(recs, wall)
    if md:
        with open(md, "w") as fh:
            fh.write(text + "\n")
    return text


# -- entry points --------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--results", required=True)
    p.add_argument("--library", choices=LIBRARIES, required=True)
    p = sub.add_parser("run")
    p.add_argument("--results", required=True)
    p.add_argument("--library", choices=LIBRARIES, required=True)
    p.add_argument("--shard", default="0/1")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--only", help="comma-separated item ids (timm.resnet,transformers.gpt2)")
    p = sub.add_parser("report")
    p.add_argument("--results", required=True)
    p.add_argument("--md")
    p = sub.add_parser("all", help="plan, run both libraries in --shards parallel processes, "
                                   "report")
    p.add_argument("--results", required=True)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--python-timm", default=sys.executable,
                   help="the interpreter with timm (its own venv: timm needs torchvision)")
    p.add_argument("--python-transformers", default=sys.executable)
    p.add_argument("--only", help="comma-separated item ids (timm.resnet,transformers.gpt2)")
    p.add_argument("--md")
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        print(f"{len(plan(args.results, args.library))} items", file=sys.stderr)
        return 0
    if args.cmd == "run":
        i, n = parse_shard(args.shard)
        if args.worker:
            return work(args.results, args.library, i, n, args.timeout, args.only)
        return drive(args.results, args.library, i, n, args.timeout, only=args.only)
    if args.cmd == "report":
        print(report(args.results, args.md))
        return 0
    t0 = time.perf_counter()
    pythons = {"timm": args.python_timm, "transformers": args.python_transformers}
    env = {**os.environ, "PYTHONPATH": ROOT}
    for lib in LIBRARIES:   # plans first (the timm one counts every model's parameters)
        subprocess.run([pythons[lib], __file__, "plan", "--results", args.results,
                        "--library", lib], env=env, check=True)
    jobs = [(lib, i) for lib in LIBRARIES for i in range(args.shards)]
    running: list = []
    while jobs or running:
        while jobs and len(running) < args.shards:
            lib, i = jobs.pop(0)
            running.append(subprocess.Popen(
                [pythons[lib], __file__, "run", "--results", args.results, "--library", lib,
                 "--shard", f"{i}/{args.shards}", "--timeout", str(args.timeout)]
                + (["--only", args.only] if args.only else []), env=env))
        time.sleep(5)
        for proc in [p for p in running if p.poll() is not None]:
            running.remove(proc)
            if proc.returncode:
                raise RuntimeError(f"{proc.args} failed (exit status {proc.returncode})")
    text = report(args.results, args.md, wall=time.perf_counter() - t0, only=args.only)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
