"""Lossless verification: pure-tensor tests of the rules in engine.sample.verify on CPU."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from engine.sample.sampling import sample_from
from engine.sample.verify import accepted_prefix, emitted, final_distribution

V = 5


def verify(target_probs, choice, draft_tokens, draft_probs, num_drafts, deterministic, uniforms, noise):
    """The three rules composed as the verifier composes them, with one noise row per sequence."""
    num_acc = accepted_prefix(target_probs, choice, draft_tokens, draft_probs, num_drafts, deterministic, uniforms)
    dist = final_distribution(target_probs, draft_tokens, draft_probs, num_acc, num_drafts)
    B = draft_tokens.shape[0]
    final = torch.where(deterministic, choice[torch.arange(B), num_acc], sample_from(dist, noise))
    return num_acc, emitted(draft_tokens, num_acc, final)


def verify_greedy(choice, draft_tokens, num_drafts):
    """An all-deterministic batch: no distributions, and the choice row is what is emitted."""
    deterministic = torch.ones(draft_tokens.shape[0], dtype=torch.bool)
    return accepted_prefix(None, choice, draft_tokens, None, num_drafts, deterministic, None), choice


def one_hot(token, v=V):
    t = torch.zeros(v)
    t[token] = 1.0
    return t


def call(target_probs, draft_tokens, num_drafts, *, draft_probs=None, greedy=None, uniforms=None, noise=None,
         target_argmax=None):
    B, K = draft_tokens.shape
    return verify(
        target_probs,
        target_probs.argmax(-1) if target_argmax is None else target_argmax,
        draft_tokens,
        draft_probs,
        num_drafts,
        torch.zeros(B, dtype=torch.bool) if greedy is None else greedy,
        torch.full((B, K), 0.5) if uniforms is None else uniforms,
        torch.ones(B, target_probs.shape[-1]) if noise is None else noise,
    )


def chi2_pvalue(tokens, p, n):
    counts = torch.bincount(tokens, minlength=len(p)).numpy()
    expected = np.asarray(p, dtype=np.float64)
    return chisquare(counts, expected / expected.sum() * n).pvalue


# ---- greedy -------------------------------------------------------------------------------------


def test_greedy_all_drafts_accepted_emits_the_bonus_argmax():
    argmax = torch.tensor([[3, 1, 4, 2]])
    drafts = torch.tensor([[3, 1, 4]])
    probs = torch.stack([one_hot(t) for t in argmax[0]])[None]  # [1, 4, V]
    num_acc, tokens = call(probs, drafts, torch.tensor([3]), greedy=torch.tensor([True]), target_argmax=argmax)
    assert num_acc.tolist() == [3]
    assert tokens[0, :4].tolist() == [3, 1, 4, 2]
    num_acc, tokens = verify_greedy(argmax, drafts, torch.tensor([3]))
    assert num_acc.tolist() == [3]
    assert tokens[0, :4].tolist() == [3, 1, 4, 2]


def test_greedy_first_mismatch_emits_the_target_argmax_there():
    argmax = torch.tensor([[3, 1, 4, 2]])
    drafts = torch.tensor([[3, 0, 4]])  # the third draft matches but follows a rejection
    probs = torch.full((1, 4, V), 1.0 / V)
    num_acc, tokens = call(probs, drafts, torch.tensor([3]), greedy=torch.tensor([True]), target_argmax=argmax)
    assert num_acc.tolist() == [1]
    assert tokens[0, :2].tolist() == [3, 1]
    num_acc, tokens = verify_greedy(argmax, drafts, torch.tensor([3]))
    assert num_acc.tolist() == [1]
    assert tokens[0, :2].tolist() == [3, 1]


def test_greedy_first_draft_wrong_accepts_nothing():
    argmax = torch.tensor([[2, 2, 2]])
    num_acc, tokens = verify_greedy(argmax, torch.tensor([[1, 2]]), torch.tensor([2]))
    assert num_acc.tolist() == [0]
    assert tokens[0, 0].item() == 2


def test_greedy_ignores_noise_and_uniforms():
    argmax = torch.tensor([[4, 0, 1]])
    probs = torch.full((1, 3, V), 1.0 / V)
    noise = torch.tensor([[1e-6, 1.0, 1.0, 1.0, 1.0]])  # would make a sampled row pick token 0
    num_acc, tokens = call(probs, torch.tensor([[4, 3]]), torch.tensor([2]), greedy=torch.tensor([True]),
                           target_argmax=argmax, noise=noise, uniforms=torch.zeros(1, 2))
    assert num_acc.tolist() == [1]
    assert tokens[0, 1].item() == 0


def test_greedy_padding_beyond_num_drafts_is_never_accepted():
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])  # padding that happens to equal the argmax
    num_acc, tokens = verify_greedy(argmax, drafts, torch.tensor([1, 0]))
    assert num_acc.tolist() == [1, 0]
    assert tokens[0, :2].tolist() == [1, 2] and tokens[1, 0].item() == 1


# ---- sampled ------------------------------------------------------------------------------------


def test_sampled_all_drafts_accepted_emits_a_bonus_from_the_last_target_distribution():
    p = torch.stack([one_hot(2), one_hot(0), one_hot(4)])[None]  # [1, 3, V]: certain tokens
    q = torch.stack([torch.full((V,), 1.0 / V)] * 2)[None]  # q(x) <= p(x): always accepted
    num_acc, tokens = call(p, torch.tensor([[2, 0]]), torch.tensor([2]), draft_probs=q,
                           uniforms=torch.tensor([[0.999, 0.999]]))
    assert num_acc.tolist() == [2]
    assert tokens[0].tolist() == [2, 0, 4]


def test_draft_with_zero_target_probability_is_always_rejected():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0, 0.0], [0.2] * 5]])
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 0.0]]])
    for drafts_q in (q, None):
        num_acc, tokens = call(p, torch.tensor([[0]]), torch.tensor([1]), draft_probs=drafts_q,
                               uniforms=torch.zeros(1, 1))  # the most accepting uniform
        assert num_acc.tolist() == [0]
        assert tokens[0, 0].item() in (1, 2)


def test_rejected_draft_is_replaced_from_the_residual_never_by_itself():
    torch.manual_seed(3)
    n = 4000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    q = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.9])  # draft token 4 has p = 0
    probs = p.expand(n, 2, V).clone()
    num_acc, tokens = call(probs, torch.full((n, 1), 4), torch.ones(n, dtype=torch.long),
                           draft_probs=q.expand(n, 1, V).clone(), uniforms=torch.rand(n, 1),
                           noise=torch.empty(n, V).exponential_())
    assert num_acc.sum().item() == 0
    # residual = max(0, p - q) = [0.1, 0.2, 0.3, 0.3, 0]: token 4 impossible, token 3 discounted.
    assert 4 not in tokens[:, 0].tolist()
    counts = torch.bincount(tokens[:, 0], minlength=V).numpy()[:4]
    assert chisquare(counts, np.array([0.1, 0.2, 0.3, 0.3]) / 0.9 * n).pvalue > 1e-3


def test_sampled_padding_beyond_num_drafts_is_never_accepted_and_the_bonus_comes_from_p_at_num_drafts():
    p = torch.stack([one_hot(1), one_hot(2), one_hot(3), one_hot(4)]).expand(2, 4, V).clone()
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3]])  # padding that p would accept for sure
    q = torch.stack([one_hot(1), one_hot(2), one_hot(3)]).expand(2, 3, V).clone()
    num_acc, tokens = call(p, drafts, torch.tensor([1, 0]), draft_probs=q, uniforms=torch.zeros(2, 3))
    assert num_acc.tolist() == [1, 0]
    assert tokens[0, :2].tolist() == [1, 2]  # bonus from p_1, not p_3
    assert tokens[1, 0].item() == 1  # no drafts: a plain sample from p_0
    num_acc, _ = call(p, drafts, torch.tensor([1, 0]), uniforms=torch.zeros(2, 3))  # one-hot proposals
    assert num_acc.tolist() == [1, 0]


def test_rows_with_different_draft_counts_are_independent():
    p = torch.stack([one_hot(1), one_hot(2), one_hot(3)]).expand(3, 3, V).clone()
    drafts = torch.tensor([[1, 2], [1, 0], [0, 2]])
    num_acc, tokens = call(p, drafts, torch.tensor([2, 2, 2]), uniforms=torch.zeros(3, 2))
    assert num_acc.tolist() == [2, 1, 0]
    assert tokens[0].tolist() == [1, 2, 3]
    assert tokens[1, :2].tolist() == [1, 2]
    assert tokens[2, 0].item() == 1


def test_no_drafts_at_all_samples_from_the_first_position():
    p = one_hot(3)[None, None]  # [1, 1, V]
    num_acc, tokens = call(p, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    assert num_acc.tolist() == [0]
    assert tokens.tolist() == [[3]]


def test_one_hot_proposal_is_accepted_with_probability_p_of_the_draft():
    torch.manual_seed(11)
    n = 20000
    p = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    probs = p.expand(n, 2, V).clone()
    num_acc, _ = call(probs, torch.full((n, 1), 1), torch.ones(n, dtype=torch.long), uniforms=torch.rand(n, 1))
    rate = num_acc.float().mean().item()
    assert abs(rate - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5


def test_one_hot_proposal_emits_tokens_distributed_as_p():
    torch.manual_seed(12)
    n = 20000
    p = [0.1, 0.3, 0.2, 0.25, 0.15]
    probs = torch.tensor(p).expand(n, 2, V).clone()
    _, tokens = call(probs, torch.full((n, 1), 1), torch.ones(n, dtype=torch.long), uniforms=torch.rand(n, 1),
                     noise=torch.empty(n, V).exponential_())
    assert chi2_pvalue(tokens[:, 0], p, n) > 1e-3


def test_first_emitted_token_is_distributed_as_the_target_for_a_different_draft_distribution():
    torch.manual_seed(2024)
    n = 20000
    p = torch.tensor([0.4, 0.05, 0.25, 0.1, 0.2])
    q = torch.tensor([0.05, 0.45, 0.1, 0.3, 0.1])  # deliberately unlike p
    drafts = torch.multinomial(q, n, replacement=True)[:, None]  # [n, 1], x ~ q
    num_acc, tokens = call(
        p.expand(n, 2, V).clone(), drafts, torch.ones(n, dtype=torch.long),
        draft_probs=q.expand(n, 1, V).clone(), uniforms=torch.rand(n, 1), noise=torch.empty(n, V).exponential_(),
    )
    first = tokens[:, 0]
    assert chi2_pvalue(first, p.tolist(), n) > 1e-3
    # The test has power: the drafts themselves (distributed as q) fail it.
    assert chi2_pvalue(drafts[:, 0], p.tolist(), n) < 1e-6
    # Acceptance rate is sum_x min(p, q).
    assert abs(num_acc.float().mean().item() - torch.minimum(p, q).sum().item()) < 0.02


def test_token_after_an_accepted_draft_follows_the_next_position_target():
    torch.manual_seed(77)
    n = 20000
    p0 = torch.tensor([0.4, 0.05, 0.25, 0.1, 0.2])
    p1 = torch.tensor([0.1, 0.1, 0.5, 0.05, 0.25])  # a different distribution at the next position
    q0 = torch.tensor([0.3, 0.2, 0.2, 0.1, 0.2])
    q1 = torch.tensor([0.05, 0.45, 0.1, 0.3, 0.1])
    drafts = torch.stack([torch.multinomial(q0, n, replacement=True), torch.multinomial(q1, n, replacement=True)], 1)
    probs = torch.stack([p0, p1, p0]).expand(n, 3, V).clone()
    q = torch.stack([q0, q1]).expand(n, 2, V).clone()
    num_acc, tokens = call(probs, drafts, torch.full((n,), 2), draft_probs=q, uniforms=torch.rand(n, 2),
                           noise=torch.empty(n, V).exponential_())
    assert chi2_pvalue(tokens[:, 0], p0.tolist(), n) > 1e-3
    after = num_acc >= 1
    m = int(after.sum())
    assert m > 5000
    assert chi2_pvalue(tokens[after, 1], p1.tolist(), m) > 1e-3
