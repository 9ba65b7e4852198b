"""Layers bound to a host module behave as that module (kernelize binds them this way);
the package imports with torch alone."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from conftest import REPO, TARGETS


class LlamaStyleRMSNorm(nn.Module):
    """transformers' Llama RMSNorm, as it is written there."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

def test_layer_follows_the_kernelize_rules(kernel):
    layer = kernel.layers.RMSNorm
    assert issubclass(layer, nn.Module)
    assert "__init__" not in vars(layer)
    assert layer.has_backward is True and layer.can_torch_compile is True

def test_rms_norm_layer_matches_the_host_module(kernel, device):
    for dtype in (torch.float32, torch.bfloat16):
        host = LlamaStyleRMSNorm(1024, eps=1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            host.weight.normal_()
        x = torch.randn(3, 17, 1024, device=device, dtype=dtype)
        expected = host(x)
        actual = kernel.layers.RMSNorm.forward(host, x)
        # Host rounds to the input dtype before the weight multiply: allow two roundings.
        tol = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-7}[dtype]
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=1e-5)
        assert actual.dtype == dtype


def test_rms_norm_layer_fp32_activations_with_a_low_precision_weight(kernel, device):
    host = LlamaStyleRMSNorm(256).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        host.weight.normal_()
    x = torch.randn(4, 256, device=device)
    expected = host(x)
    actual = kernel.layers.RMSNorm.forward(host, x)
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_layers_take_row_views_and_send_the_others_to_the_host(kernel, device):
    """What the layers hand to the row ops without a copy: a contiguous last dim and
    leading dims that collapse into one row stride, on a dtype and device the ops take."""
    rows = kernel.layers._rows
    x = torch.randn(2, 8, 64, device=device)
    qkv = torch.randn(2, 8, 3 * 64, device=device)
    assert rows(x) and rows(x.bfloat16()) and rows(x[:, :1]) and rows(x[:1])
    assert rows(qkv[..., :64]) and rows(qkv[..., 64:128])  # fused-projection slices: one row stride
    assert not rows(x[:, 3:])  # FLUX's x[:, text_len:]: rows of two strides
    assert not rows(x.transpose(1, 2))  # last dim not contiguous
    assert not rows(x.double()) and not rows(x.to(torch.int32))
    assert not rows(torch.tensor(1.0, device=device))
    assert not rows(torch.empty(2, 8, 64, device="meta"))


# Imports a built variant's folder as a package with kernels, transformers and diffusers
# blocked, calls an op on CPU tensors and finds the integration's entry points.
ONLY_TORCH = textwrap.dedent("""
    import importlib.abc, importlib.util, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("kernels", "transformers", "diffusers"):
                raise ImportError(f"{name} is blocked here")
            return None

    sys.meta_path.insert(0, Blocked())
    import torch

    variant = sys.argv[1]
    spec = importlib.util.spec_from_file_location("ltx_kernels_only_torch", variant + "/__init__.py",
                                                  submodule_search_locations=[variant])
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    x = torch.randn(3, 64)
    torch.testing.assert_close(package.rms_norm(x, None, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    for name in ("kernelize_diffusers", "kernelize_transformers", "unkernelize", "replaced_modules",
                 "transformers_mapping", "diffusers_mapping"):
        assert callable(getattr(package, name)) and name in package.__all__, name
    loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("kernels", "transformers", "diffusers"))
    assert not loaded, loaded
    print("ok")
""")


@pytest.mark.parametrize("backend", sorted({b for b, _ in TARGETS}))
def test_the_package_imports_with_torch_alone(backend):
    variants = [p for p in sorted((REPO / "build").glob("*/metadata.json"))
                if json.loads(p.read_text())["backend"]["type"] == backend]
    assert variants, f"no {backend} variant in build/: run `python -m builder` first"
    done = subprocess.run([sys.executable, "-c", ONLY_TORCH, str(variants[0].parent)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
