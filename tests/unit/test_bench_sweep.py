"""benchmarks/bench_sweep.py's bookkeeping (the sweep itself runs in ``make bench``): how the
libraries are enumerated, sharded and resumed, how configs are shrunk, how rows are classed."""
import json
import logging
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_sweep as B  # noqa: E402


def test_timm_models_grouped_by_module_smallest_first():
    owner = {"resnet50": "timm.models.resnet", "resnet18": "timm.models.resnet",
             "test_resnet": "timm.models.resnet", "odd": "timm.models.resnet",
             "vit_b": "timm.models.vision_transformer"}
    params = {"resnet50": 25_000_000, "resnet18": 11_000_000, "test_resnet": 400_000,
              "odd": None, "vit_b": 86_000_000}
    assert B.group_by_module(owner, params, candidates=3) == [
        {"id": "timm.resnet", "library": "timm", "family": "resnet", "models": 4,
         "candidates": [["test_resnet", 400_000], ["resnet18", 11_000_000],
                        ["resnet50", 25_000_000]]},
        {"id": "timm.vision_transformer", "library": "timm", "family": "vision_transformer",
         "models": 1, "candidates": [["vit_b", 86_000_000]]}]


def test_transformers_types_take_their_first_head_in_order():
    maps = {"MASKED_LM_x": {}, "MASKED_LM": {"bert": "BertForMaskedLM", "gpt2": "X"},
            "CAUSAL_LM": {"gpt2": "GPT2LMHeadModel", "bert": "BertLMHeadModel"},
            "IMAGE_CLASSIFICATION": {"vit": ("ViTForImageClassification", "Other")}}
    assert B.heads_by_type(maps) == [
        {"id": "transformers.bert", "library": "transformers", "family": "bert", "task": "lm",
         "cls": "BertLMHeadModel"},
        {"id": "transformers.gpt2", "library": "transformers", "family": "gpt2", "task": "lm",
         "cls": "GPT2LMHeadModel"},
        {"id": "transformers.vit", "library": "transformers", "family": "vit", "task": "image",
         "cls": "ViTForImageClassification"}]


def test_shards_partition_the_plan():
    items = [{"id": f"x.{c}"} for c in "edcba"]
    parts = [[it["id"] for it in B.shard(items, i, 2)] for i in range(2)]
    assert parts == [["x.a", "x.c", "x.e"], ["x.b", "x.d"]]
    assert B.parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="accepted: i/n"):
            B.parse_shard(bad)


def test_shrink_overrides_sizes_keeps_lists_consistent():
    cfg = {"hidden_size": 768, "num_hidden_layers": 5, "num_attention_heads": 12,
           "num_key_value_heads": 4, "intermediate_size": 3072, "vocab_size": 50000,
           "pad_token_id": 49999, "eos_token_id": [7, 1], "max_position_embeddings": 4096,
           "layer_types": ["linear", "linear", "linear", "full", "linear"], "dropout": 0.1,
           "tie_word_embeddings": True, "num_local_experts": 8, "num_experts_per_tok": 2,
           "vision_config": {"hidden_sizes": [96, 192, 384, 768], "depths": [3, 3, 9, 3],
                             "num_heads": [3, 6, 12, 24], "image_size": 224,
                             "num_channels": 3}}
    assert B.shrink(cfg) == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "pad_token_id": 1, "eos_token_id": [1, 1], "max_position_embeddings": 128,
        "layer_types": ["linear", "full"], "num_local_experts": 4,
        "vision_config": {"hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
                          "num_heads": [1, 2, 4, 8], "image_size": 64, "num_channels": 3}}
    # three distinct layer types do not fit in 2 layers: the layer count grows to keep them
    out = B.shrink({"num_hidden_layers": 6, "layer_types": list("aabbac")})
    assert out == {"num_hidden_layers": 3, "layer_types": ["a", "b", "c"]}


def test_rows_are_classed_known_only_as_the_named_defects():
    row = {"api_name": "Functional.layer_norm.3.backward", "pert_mode": "improve_precision",
           "cause": "inaccurate"}
    assert B.known_class(row, "bf16", "backward") == "bf16 layer_norm backward"
    assert B.known_class(row, "autocast", "backward") == "bf16 layer_norm backward"
    assert B.known_class(row, "fp32", "backward") is None
    assert B.known_class(row, "bf16", "forward") is None
    assert B.known_class({**row, "cause": "ill-conditioned"}, "bf16", "backward") is None
    # the float64 verdict decides, whichever step's check flagged the call
    assert B.known_class({**row, "pert_mode": "bit_noise"}, "bf16", "backward") == \
        "bf16 layer_norm backward"
    ce = {**row, "api_name": "Functional.cross_entropy.0.forward"}
    assert B.known_class(ce, "bf16", "forward") == "bf16 cross_entropy/nll_loss mean"
    assert B.known_class({**row, "api_name": "Torch.matmul.0.backward"}, "bf16",
                         "backward") is None


def _item(family):
    return {"id": f"timm.{family}", "library": "timm", "family": family, "candidates": [],
            "models": 0}


def test_resume_skips_done_items_and_records_failures(tmp_path):
    res = str(tmp_path)
    items = [_item("done"), _item("no_such_type")]
    with open(os.path.join(res, "plan-timm.json"), "w") as fh:
        json.dump({"items": items}, fh)
    os.makedirs(os.path.join(res, "timm"))
    done = os.path.join(res, "timm", "done.json")
    with open(done, "w") as fh:
        fh.write('{"status": "kept"}')
    assert [it["id"] for it in B.pending(res, items)] == ["timm.no_such_type"]
    import torch

    # the worker, in this process: a module with no candidate fails to build, recorded; what a
    # worker process sets for itself (threads, probekit's log level, the alarm) is set back
    threads, level = torch.get_num_threads(), logging.getLogger("probekit").level
    alarm = signal.getsignal(signal.SIGALRM)
    try:
        assert B.work(res, "timm", 0, 1, timeout=60) == 0
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("probekit").setLevel(level)
        signal.signal(signal.SIGALRM, alarm)
    with open(done) as fh:
        assert fh.read() == '{"status": "kept"}'            # not run again
    with open(os.path.join(res, "timm", "no_such_type.json")) as fh:
        rec = json.load(fh)
    assert (rec["status"], rec["error"]["where"], rec["error"]["type"]) == \
        ("failed", "build", "BuildError")
    assert rec["error"]["message"].startswith("no candidate builds and trains a plain fp32 step")
    assert sorted(os.listdir(os.path.join(res, "timm"))) == ["done.json",
                                                                     "no_such_type.json"]
    assert B.pending(res, items) == []
    # the driver of a finished shard removes an interrupted run's marker and starts no worker
    marker = done + ".started"
    open(marker, "w").close()
    assert B.drive(res, "timm", 0, 1, timeout=60, python="/nonexistent") == 0
    assert not os.path.exists(marker)


def test_analysed_classes_come_before_the_known_list():
    def f(api, shape, cause="ill-conditioned", mode="bit_noise", site="norm_act.py:136"):
        return {"api_name": f"{api}.0.backward", "shape": shape, "cause": cause, "pert_mode": mode,
                "call_site": site, "ratio": None, "kind": "rel_error"}
    rec = {"library": "timm", "family": "inception_v3", "spec": {"model": "m"}, "configs": [
        {"dtype": "bf16", "stage": "backward", "findings": [
            f("Functional.batch_norm", "(2, 192, 1, 1)"),            # 2 values per channel
            f("Functional.batch_norm", "(192,)"),                    # its weight gradient
            f("Functional.batch_norm", "(64,)"),                     # another layer's
            f("Functional.batch_norm", "(64,)", cause="inaccurate", mode="improve_precision")]}]}
    csat = {"library": "timm", "family": "csatv2", "spec": {"model": "c"}, "configs": [
        {"dtype": "bf16", "stage": "backward", "findings": [
            f("Functional.layer_norm", "(1,)", cause="inaccurate", mode="improve_precision")]}]}
    rows = B.rows_of([rec, csat])
    assert [(x["two_sample"], x["cls"], x["category"]) for x in rows] == [
        (True, "M2", "model"), (True, "M2", "model"), (False, "?", "unclassified"),
        (False, "known", "known"), (False, "N", "genuine")]
    assert B.ratio(rows[0]) == float("inf")
