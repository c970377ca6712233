import torch

from probekit.cli import main
from probekit.freebench import FreeBench


def test_report_ranks_findings(tmp_path, capsys):
    fb = FreeBench(dump_path=str(tmp_path), pert_mode="bit_noise")
    a, b = torch.tensor([1e4 + 0.01]), torch.tensor([-1e4])
    c, d = torch.tensor([258.0], dtype=torch.bfloat16), torch.tensor([256.0], dtype=torch.bfloat16)
    with fb:
        a + b
        c - d
    assert main(["freebench", "report", str(tmp_path), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: 2 finding(s)")
    worst = out.split("worst 2:\n")[1].splitlines()
    # ratio 500 (0.1 / 0.0002) before ratio 64 (1.0 / 0.015625)
    assert "Tensor.__add__.0.forward" in worst[1] and "Tensor.__sub__.0.forward" in worst[2]
    assert "Tensor.__add__" in out.split("per API")[1]


def test_report_reads_msprobe_csv_and_missing_path(tmp_path, capsys):
    (tmp_path / "free_benchmark.csv").write_text(
        "rank,pert_mode,stage,step,api_name,max_rel,dtype,shape,output_index\n"
        "0,bit_noise,forward,0,Torch.add.0.forward,0.1,torch.float32,torch.Size([1]),\n"
        "0,bit_noise,forward,0,Tensor.add.0.forward,0.5,torch.float32,torch.Size([1]),\n")
    assert main(["freebench", "report", str(tmp_path / "free_benchmark.csv")]) == 0
    worst = capsys.readouterr().out.split("worst 2:\n")[1].splitlines()
    assert "Tensor.add.0.forward" in worst[1]
    assert main(["freebench", "report", str(tmp_path / "nope")]) == 2
    assert "no free-benchmark CSV" in capsys.readouterr().err
