"""suspects(): modules owning the first diverging parameters, ranked by earliest flagged step,
then lowest similarity; the similarity shown is the flagged parameter's (the number behind the
flag), the module's own labelled module_similarity; the cmp.probekit accessor; names checked
against a model."""
import numpy as np
import pytest
import xarray as xr
from torch import nn

import probekit
from probekit.grads import suspects
from probekit.grads.compare.suspects import param_module

PARAMS = ["embed.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.mlp.fc.weight",
          "h.1.attn.c_attn.weight", "scale"]
NUMEL = [100, 30, 10, 40, 30, 4]


def comparison(flagged, ranks=(0,), steps=4):
    """A compare_grads-shaped Dataset: similarity 1 except ``{(rank, step, param): sim}``,
    flagged there."""
    sim = np.ones((len(ranks), steps, len(PARAMS)))
    flag = np.zeros(sim.shape, bool)
    for (r, s, p), v in flagged.items():
        idx = (ranks.index(r), s, PARAMS.index(p))
        sim[idx], flag[idx] = v, True
    return xr.Dataset({"similarity": (("rank", "step", "param"), sim),
                       "flag": (("rank", "step", "param"), flag)},
                      coords={"rank": list(ranks), "step": np.arange(steps), "param": PARAMS,
                              "numel": ("param", NUMEL)})


FLAGGED = {(0, 2, "h.1.attn.c_attn.weight"): 0.90, (0, 2, "h.0.attn.c_attn.weight"): 0.75,
           (0, 2, "h.0.attn.c_attn.bias"): 0.875, (0, 3, "h.0.attn.c_attn.bias"): 0.70,
           (0, 3, "h.0.mlp.fc.weight"): 0.50, (0, 1, "embed.weight"): 0.95}


def test_ranked_by_earliest_step_then_lowest_similarity():
    df = suspects(comparison(FLAGGED))
    assert list(df.columns) == ["module", "step", "similarity", "params", "rank",
                                "module_similarity", "kind", "forward"]
    assert df.to_dict("records") == [
        {"module": "embed", "step": 1, "similarity": 0.95, "params": ("embed.weight",), "rank": 0,
         "module_similarity": 0.95, "kind": "threshold", "forward": -1},
        # the similarity of its lowest flagged parameter, the one behind the flag; the module's
        # own element-weighted over its parameters: (0.75 * 30 + 0.875 * 10) / 40
        {"module": "h.0.attn.c_attn", "step": 2, "similarity": 0.75,
         "params": ("h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias"), "rank": 0,
         "module_similarity": 0.78125, "kind": "threshold", "forward": -1},
        {"module": "h.1.attn.c_attn", "step": 2, "similarity": 0.90,
         "params": ("h.1.attn.c_attn.weight",), "rank": 0, "module_similarity": 0.90,
         "kind": "threshold", "forward": -1},
        {"module": "h.0.mlp.fc", "step": 3, "similarity": 0.50, "params": ("h.0.mlp.fc.weight",),
         "rank": 0, "module_similarity": 0.50, "kind": "threshold", "forward": -1}]
    assert list(suspects(comparison(FLAGGED), top=2)["module"]) == ["embed", "h.0.attn.c_attn"]
    cmp = comparison(FLAGGED)
    assert cmp.probekit.suspects(top=1)["module"].tolist() == ["embed"]


def test_ranks_and_root_parameters_and_nothing_flagged():
    flagged = {**FLAGGED, (1, 0, "h.0.mlp.fc.weight"): 0.99, (1, 2, "scale"): 0.0}
    df = suspects(comparison(flagged, ranks=(0, 1)))
    assert df[["module", "step", "rank"]].values.tolist() == [
        ["h.0.mlp.fc", 0, 1], ["embed", 1, 0], ["", 2, 1], ["h.0.attn.c_attn", 2, 0],
        ["h.1.attn.c_attn", 2, 0]]
    empty = suspects(comparison({}))
    assert empty.empty and list(empty.columns) == ["module", "step", "similarity", "params",
                                                   "rank", "module_similarity", "kind",
                                                   "forward"]


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(2, 2)


def test_names_checked_against_the_model():
    model = nn.Module()
    model.h = nn.ModuleList([nn.Module(), nn.Module()])
    for blk in model.h:
        blk.attn = Attn()
    modules = dict(model.named_modules())
    assert param_module("h.1.attn.c_attn.weight", modules) == "h.1.attn.c_attn"
    assert param_module("module._orig_mod.h.1.attn.c_attn.weight", modules) == "h.1.attn.c_attn"
    assert param_module("scale") == "" and param_module("scale", modules) == ""
    with pytest.raises(ValueError, match=r"parameter 'embed\.weight': its module "
                       r"'embed' is not in the model"):
        suspects(comparison(FLAGGED), model=model)


def test_on_a_real_comparison(grads_cmp):
    df = grads_cmp.probekit.suspects()
    assert df["module"].tolist() == ["encoder.layers.0.self_attn"]
    assert df.loc[0, "step"] == 4 and df.loc[0, "params"] == (
        "encoder.layers.0.self_attn.in_proj_weight",)
    judged = "similarity_significant" if grads_cmp.attrs.get("noise_aware") else "similarity"
    assert df.loc[0, "similarity"] == float(grads_cmp[judged].sel(
        rank=0, step=4, param="encoder.layers.0.self_attn.in_proj_weight"))
    assert probekit.suspects is suspects


def test_walk_back_to_where_the_divergence_starts():
    """The first suspect departs most; the suspects flagged at the same step that run before
    it in the forward pass are where the divergence may start, nearest first (issue 35: a conv
    summing one tap was named through the module after it)."""
    from probekit.grads.compare.suspects import walk_back, walk_back_text

    order = ["", "embed", "h", "h.0", "h.0.attn", "h.0.attn.c_attn", "h.0.mlp", "h.0.mlp.fc",
             "h.1", "h.1.attn", "h.1.attn.c_attn"]
    flagged = {(0, 2, "h.1.attn.c_attn.weight"): 0.50, (0, 2, "h.0.attn.c_attn.weight"): 0.90,
               (0, 2, "embed.weight"): 0.95, (0, 3, "h.0.mlp.fc.weight"): 0.10}
    df = suspects(comparison(flagged), order=order)
    assert df[["module", "step", "forward"]].values.tolist() == [
        ["h.1.attn.c_attn", 2, 10], ["h.0.attn.c_attn", 2, 5], ["embed", 2, 1],
        ["h.0.mlp.fc", 3, 7]]
    assert walk_back(df) == ["h.0.attn.c_attn", "embed"]  # nearest first; step 3 not
    assert walk_back(df, "h.0.attn.c_attn") == ["embed"]
    assert walk_back_text(df) == (
        "h.1.attn.c_attn departs most at step 2, but a wrong forward output changes the "
        "gradients of every module after it: flagged at the same step and earlier in the "
        "forward pass: h.0.attn.c_attn, embed (nearest first). Walk back through them: where "
        "the divergence starts is the earliest whose own calls are wrong (triage checks the "
        "nearest too).")
    assert walk_back(suspects(comparison(flagged))) == []  # no forward order: nothing to say
    model = nn.Module()
    model.embed = nn.Linear(2, 2)
    model.h = nn.ModuleList([nn.Module(), nn.Module()])
    for blk in model.h:
        blk.attn = Attn()
    model.h[0].mlp = nn.Module()
    model.h[0].mlp.fc = nn.Linear(2, 2)
    with_model = suspects(comparison({k: v for k, v in flagged.items() if k[2] != "scale"}),
                          model=model)  # the model's construction order
    assert with_model["forward"].tolist() == [10, 5, 1, 7]
