import numpy as np

from flashdraft.dedup import MinHasher, lsh_params, near_duplicates


def _jaccard(a: str, b: str, k: int = 5) -> float:
    def sh(t):
        w = t.split()
        return {tuple(w[i : i + k]) for i in range(len(w) - k + 1)}

    return len(sh(a) & sh(b)) / len(sh(a) | sh(b))


def _texts(n: int, words: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(f"w{j}" for j in rng.integers(0, 50_000, words)) for _ in range(n)]


def test_signature_estimates_jaccard():
    base = _texts(1, 60)[0].split()
    mh = MinHasher(num_perm=256)
    for cut in (0, 5, 15, 30):
        other = " ".join(base[: 60 - cut] + [f"x{i}" for i in range(cut)])
        sig = mh.signatures([" ".join(base), other])
        est, true = (sig[0] == sig[1]).mean(), _jaccard(" ".join(base), other)
        assert abs(est - true) < 0.1, (cut, est, true)


def test_normalization_short_and_wordless_texts():
    mh = MinHasher()
    sig = mh.signatures(
        ["Hello, World: how are you today?", "hello world how are you today", "Hi!", "hi", "?!", "..."]
    )
    assert (sig[0] == sig[1]).all() and (sig[2] == sig[3]).all()  # case and punctuation do not count
    assert (sig[0] != sig[2]).all() and not (sig[4] == sig[5]).all()  # wordless texts match only themselves
    again = MinHasher().signatures(["Hello, World: how are you today?", "Hi!"])
    assert (again == sig[[0, 2]]).all()  # seeded: the same across instances and runs
    assert MinHasher(seed=1).signatures(["Hi!"]).tolist() != again[1:].tolist()


def test_lsh_params():
    b, r = lsh_params(0.85, 64)
    assert b * r <= 64 and 1 - (1 - 0.85**r) ** b >= 0.99
    assert 1 - (1 - 0.85 ** (r + 1)) ** (64 // (r + 1)) < 0.99  # the most selective banding that qualifies


def test_near_duplicates_planted():
    texts = _texts(3000)
    planted = {}
    for i in range(0, 3000, 30):  # a later copy with one extra word and different case
        planted[len(texts)] = i
        texts.append(texts[i].upper() + " thanks")
    for i in range(5, 3000, 30):  # a later copy with a third of the words replaced: similar, but not near
        texts.append(" ".join(texts[i].split()[:26] + [f"z{j}" for j in range(14)]))
    dup = near_duplicates(MinHasher().signatures(texts), 0.85)
    assert set(np.flatnonzero(dup)) == set(planted)  # every planted copy, nothing else, originals kept
    assert not near_duplicates(MinHasher().signatures(texts[:1]), 0.85).any()
