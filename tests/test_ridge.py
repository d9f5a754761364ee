import torch

from kvferry.mappings.lab.gram import GramStats
from kvferry.mappings.lab.ridge import cols, heldout_r2_path, select_and_fit, solve


def _data(n, dx, dy, seed, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dx, dy, generator=g, dtype=torch.float64)
    x = torch.randn(n, dx, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, dx, dtype=torch.float64) + 2.0
    y = x @ w + 0.5 + noise * torch.randn(n, dy, generator=g, dtype=torch.float64)
    return x, y


def test_streaming_gram_equals_one_shot_and_merges():
    x, y = _data(600, 6, 3, 0)
    one, a, b = GramStats(6, 3), GramStats(6, 3), GramStats(6, 3)
    one.add(x, y)
    for i in range(0, 300, 37):
        a.add(x[i : min(i + 37, 300)], y[i : min(i + 37, 300)])
    b.add(x[300:], y[300:])
    m = a.merge(b)
    assert m.n == one.n
    for t1, t2 in zip(m.tensors(), one.tensors()):
        torch.testing.assert_close(t1, t2)


def test_closed_form_matches_direct_ridge():
    x, y = _data(500, 5, 4, 1)
    s = GramStats(5, 4)
    s.add(x, y)
    lam_rel = 1e-2
    w, b = solve(s, torch.arange(5), torch.arange(4), lam_rel)
    xc, yc = x - x.mean(0), y - y.mean(0)
    gram = xc.T @ xc
    lam = lam_rel * float(torch.linalg.eigvalsh(gram).clamp(min=0).mean())
    w_ref = torch.linalg.solve(gram + lam * torch.eye(5, dtype=torch.float64), xc.T @ yc)
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(b, y.mean(0) - x.mean(0) @ w_ref)


def test_heldout_r2_path_matches_explicit_residuals():
    x, y = _data(800, 7, 3, 2, noise=0.5)
    tr, ho = GramStats(7, 3), GramStats(7, 3)
    tr.add(x[:600], y[:600])
    ho.add(x[600:], y[600:])
    lambdas = (1e-4, 1e-1, 3.0)
    path = heldout_r2_path(tr, ho, torch.arange(7), torch.arange(3), lambdas)
    for lam, r2 in zip(lambdas, path):
        w, b = solve(tr, torch.arange(7), torch.arange(3), lam)
        resid = y[600:] - (x[600:] @ w + b)
        ref = 1 - (resid**2).sum() / ((y[600:] - y[600:].mean(0)) ** 2).sum()
        torch.testing.assert_close(r2, ref)


def test_greedy_selection_finds_the_informative_layers():
    g = torch.Generator().manual_seed(3)
    n, w = 1500, 4
    layers = [torch.randn(n, w, generator=g, dtype=torch.float64) for _ in range(5)]
    x = torch.cat(layers, 1)
    y = layers[1] @ torch.randn(w, w, generator=g, dtype=torch.float64) + layers[3] @ torch.randn(
        w, w, generator=g, dtype=torch.float64
    )
    tr, ho = GramStats(5 * w, w), GramStats(5 * w, w)
    tr.add(x[:1200], y[:1200])
    ho.add(x[1200:], y[1200:])
    for selection in ("greedy", "ranked"):
        chosen, fit = select_and_fit(
            tr, ho, torch.arange(w), {l: cols([l], w) for l in range(5)}, k=2, selection=selection
        )
        assert chosen == [1, 3], selection
        assert fit.heldout_r2 > 0.999
    assert cols([1, 3], w).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_ranked_selection_can_miss_what_greedy_finds():
    """Greedy selection adds what helps given the layers already chosen; ranking by R² alone does not. Here layer 2
    is the best single predictor but a copy of layer 0's signal, and layer 4 carries the rest: greedy takes [2, 4]
    (or [0, 4]); ranked takes the two near-duplicates."""
    g = torch.Generator().manual_seed(5)
    n, w = 2000, 3
    base = [torch.randn(n, w, generator=g, dtype=torch.float64) for _ in range(5)]
    base[2] = base[0] + 0.05 * torch.randn(n, w, generator=g, dtype=torch.float64)
    y = 2 * base[0] + 0.8 * base[4]
    x = torch.cat(base, 1)
    tr, ho = GramStats(5 * w, w), GramStats(5 * w, w)
    tr.add(x[:1600], y[:1600])
    ho.add(x[1600:], y[1600:])
    blocks = {l: cols([l], w) for l in range(5)}
    greedy, gf = select_and_fit(tr, ho, torch.arange(w), blocks, k=2)
    ranked, rf = select_and_fit(tr, ho, torch.arange(w), blocks, k=2, selection="ranked")
    assert 4 in greedy and ranked == [0, 2]
    assert gf.heldout_r2 > rf.heldout_r2 + 0.05


def test_rounding_aware_path_matches_rounded_weights_and_prefers_smaller_weights():
    """The bf16 noise term predicts the held-out loss of maps applied with rounded inputs and weights."""
    from kvferry.mappings.lab.ridge import rounding_variance

    g = torch.Generator().manual_seed(5)
    n, dx, dy = 4000, 24, 6
    base = torch.randn(n, 4, generator=g, dtype=torch.float64)
    x = base @ torch.randn(4, dx, generator=g, dtype=torch.float64) + 1e-3 * torch.randn(
        n, dx, generator=g, dtype=torch.float64
    )
    y = x @ torch.randn(dx, dy, generator=g, dtype=torch.float64) + 0.01 * torch.randn(
        n, dy, generator=g, dtype=torch.float64
    )
    tr, ho = GramStats(dx, dy), GramStats(dx, dy)
    tr.add(x[:3000], y[:3000])
    ho.add(x[3000:], y[3000:])
    lambdas = (1e-8, 1e-6, 1e-4, 1e-2)
    xi, yi = torch.arange(dx), torch.arange(dy)
    plain = heldout_r2_path(tr, ho, xi, yi, lambdas)
    noisy = heldout_r2_path(tr, ho, xi, yi, lambdas, rounding_variance("bfloat16"))
    assert rounding_variance("float32") == 0.0
    assert torch.all(noisy <= plain + 1e-12)  # rounding only adds error
    assert int(torch.argmax(noisy)) > int(torch.argmax(plain))  # near-collinear inputs: a larger lambda wins in bf16
    yh, xh = y[3000:], x[3000:]
    sst = ((yh - yh.mean(0)) ** 2).sum()
    for lam, predicted in zip(lambdas, noisy):  # the prediction is an expectation: check it on the real rounding
        w, b = solve(tr, xi, yi, lam)
        got = xh.bfloat16().double() @ w.bfloat16().double() + b
        r2 = 1 - ((yh - got) ** 2).sum() / sst
        assert abs(float(r2) - float(predicted)) < 0.5 * (1 - float(predicted)) + 1e-3
