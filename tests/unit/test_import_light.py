"""``import probekit`` must work with the notebook/plotting/storage stack absent."""
import subprocess
import sys
import textwrap

BLOCKED = ("IPython", "ipywidgets", "matplotlib", "zarr")


def test_import_with_heavy_modules_blocked(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {BLOCKED!r}:
                    raise ImportError("blocked: " + name)
                return None
        sys.meta_path.insert(0, Block())
        import probekit
        from probekit import PrecisionDebugger, make_config, load_config
        cfg = make_config("free_benchmark", dump_path={str(tmp_path)!r}, pert_mode="bit_noise")
        assert cfg.free_benchmark.pert_mode == "bit_noise"
        PrecisionDebugger(config=cfg).close()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
        print("loaded:", loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded: []"
