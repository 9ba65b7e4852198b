"""Fits the polynomial of `normal_cdf` in kernel_src/activation_math.h (exact GELU's Phi).

Phi(-t) = 2^(-log2(e)/2 t^2 + Q(t)) for t >= 0, where Q(t) = log2(erfcx(t / sqrt 2) / 2)
is smooth and slowly varying (Q(0) = -1, Q ~ -log2(t sqrt(2 pi)) for large t), so a
polynomial fits it on [0, R] where log2(Phi(-t)) itself, or erf, needs a piecewise one.
Minimax in the absolute error of Q (the relative error of Phi(-t) is ln 2 times it) by
Lawson's reweighted least squares, in fp64. Prints the coefficients, lowest first.

    python tools/fit_normal_cdf.py [--degree 10] [--range 6]
"""

import argparse
import math

import torch


def q_target(t: torch.Tensor) -> torch.Tensor:
    lower = torch.tensor([0.5 * math.erfc(v / math.sqrt(2)) for v in t.tolist()], dtype=torch.float64)
    return torch.log2(lower) + 0.5 / math.log(2) * t * t


def fit(degree: int, r: float, points: int = 20000, rounds: int = 200) -> torch.Tensor:
    t = torch.linspace(0, r, points, dtype=torch.float64)
    powers = torch.stack([t**k for k in range(degree + 1)], 1)
    target = q_target(t)
    weight = torch.ones_like(t)
    for _ in range(rounds):
        coef = torch.linalg.lstsq(powers * weight[:, None], (target * weight)[:, None]).solution[:, 0]
        err = (powers @ coef - target).abs()
        weight = weight * (err / err.max()) ** 0.7 + 1e-14
        weight = weight / weight.max()
    return coef


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degree", type=int, default=10)
    parser.add_argument("--range", type=float, default=6.0)
    args = parser.parse_args()
    coef = fit(args.degree, args.range)
    t = torch.linspace(0, args.range, 100001, dtype=torch.float64)
    err = (sum(c * t**k for k, c in enumerate(coef.tolist())) - q_target(t)).abs().max().item()
    print(f"max |Q error| {err:.2e} (relative error of Phi {err * math.log(2):.2e}) on [0, {args.range}]")
    print(",\n".join(f"{c:.9e}f" for c in coef.float().tolist()))


if __name__ == "__main__":
    main()
