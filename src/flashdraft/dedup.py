"""Near-duplicate detection: MinHash signatures over word n-gram shingles, LSH banding, verified pairs.

Everything is vectorized numpy over batches of texts: words are found on the UTF-8 bytes (runs of ASCII
letters/digits or non-ASCII bytes, lowercased), so punctuation, case and whitespace never make two
prompts differ. Hashes are seeded constants, so results are identical across runs and machines.
"""

from __future__ import annotations

import numpy as np

MASK32 = np.uint64(0xFFFFFFFF)
_WORD = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyz0123456789":
    _WORD[_c] = True
_WORD[128:] = True  # bytes of non-ASCII characters belong to words


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: spreads every input bit over the whole word (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class MinHasher:
    """MinHash signatures (uint32 [n, num_perm]) of texts, shingled into `ngram`-word windows."""

    def __init__(self, num_perm: int = 64, ngram: int = 5, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.num_perm, self.ngram = num_perm, ngram
        self.byte_key = rng.integers(1, 2**63, 256, dtype=np.uint64)
        self.pos_key = rng.integers(1, 2**63, 64, dtype=np.uint64) | np.uint64(1)
        self.word_key = rng.integers(1, 2**63, max(ngram, 1), dtype=np.uint64) | np.uint64(1)
        self.a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) | np.uint64(1)  # odd: a bijection
        self.b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)

    def shingles(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(shingle hashes uint64, row of each) sorted by row; every row has at least one shingle."""
        enc = [t.lower().encode("utf-8") for t in texts]
        n = len(enc)
        buf = np.frombuffer(b"\n".join(enc), dtype=np.uint8)  # "\n" keeps rows' words apart
        row_start = np.zeros(n, dtype=np.int64)
        np.cumsum(np.fromiter((len(e) + 1 for e in enc[:-1]), np.int64, n - 1), out=row_start[1:])
        isw = _WORD[buf]
        pos = np.flatnonzero(isw)
        starts = np.flatnonzero(isw & ~np.concatenate(([False], isw[:-1])))
        with np.errstate(over="ignore"):
            words = np.zeros(0, np.uint64)
            if len(pos):
                first = np.searchsorted(pos, starts)  # where each word begins within `pos`
                mark = np.zeros(len(pos), np.int64)
                mark[first] = 1
                wid = np.cumsum(mark) - 1
                offset = np.arange(len(pos)) - first[wid]
                contrib = self.byte_key[buf[pos]] * self.pos_key[offset & 63]
                words = _mix(np.add.reduceat(contrib, first))
            wrow = np.searchsorted(row_start, starts, side="right") - 1
            count = np.bincount(wrow, minlength=n)
            k, parts, rows = self.ngram, [], []
            if len(words) >= k:  # full windows of k words inside one row
                m = len(words) - k + 1
                ok = wrow[:m] == wrow[k - 1 :]
                h = np.zeros(m, np.uint64)
                for j in range(k):
                    h += words[j : j + m] * self.word_key[j]
                parts.append(_mix(h[ok]))
                rows.append(wrow[:m][ok])
            short = (count > 0) & (count < k)  # rows with fewer than k words: one shingle of all of them
            if short.any():
                sel = short[wrow]
                srow = wrow[sel]
                first_of_row = np.searchsorted(srow, srow)
                idx = np.arange(len(srow)) - first_of_row
                h = np.add.reduceat(words[sel] * self.word_key[idx], np.unique(first_of_row))
                parts.append(_mix(h))
                rows.append(np.flatnonzero(short))
            empty = np.flatnonzero(count == 0)  # no word at all: the bytes themselves, so only equals match
            if len(empty):
                parts.append(_mix(np.array([hash_bytes(enc[i]) for i in empty], np.uint64)))
                rows.append(empty)
        sh, rw = np.concatenate(parts), np.concatenate(rows)
        order = np.argsort(rw, kind="stable")
        return sh[order], rw[order]

    def signatures(self, texts: list[str], perm_block: int = 16) -> np.ndarray:
        sh, rw = self.shingles(texts)
        bounds = np.flatnonzero(np.concatenate(([True], rw[1:] != rw[:-1])))
        sig = np.empty((len(texts), self.num_perm), np.uint32)
        with np.errstate(over="ignore"):
            for p in range(0, self.num_perm, perm_block):  # blocks bound the [perms, shingles] temporary
                a, b = self.a[p : p + perm_block, None], self.b[p : p + perm_block, None]
                h = (sh[None, :] * a + b) >> np.uint64(32)  # multiply-shift: the high half is well mixed
                sig[:, p : p + perm_block] = np.minimum.reduceat(h, bounds, axis=1).T
        return sig


def hash_bytes(data: bytes) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def lsh_params(threshold: float, num_perm: int, recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows per band): the most rows per band that still makes a pair at `threshold` a
    candidate with probability >= recall; candidates are verified afterwards, so recall is what counts."""
    best = (num_perm, 1)
    for r in range(1, num_perm + 1):
        b = num_perm // r
        if 1 - (1 - threshold**r) ** b >= recall:
            best = (b, r)
    return best


def near_duplicates(sig: np.ndarray, threshold: float, chunk: int = 1 << 18) -> np.ndarray:
    """Boolean mask of rows whose estimated Jaccard similarity with an earlier row sharing an LSH bucket
    is >= threshold. The earliest row of every bucket is the reference, so the first of a group stays."""
    n, num_perm = sig.shape
    dup = np.zeros(n, dtype=bool)
    if n < 2:
        return dup
    bands, r = lsh_params(threshold, num_perm)
    for band in range(bands):
        cols = sig[:, band * r : (band + 1) * r].astype(np.uint64)
        h = np.zeros(n, np.uint64)
        with np.errstate(over="ignore"):
            for j in range(r):
                h = _mix(h ^ cols[:, j])
        order = np.argsort(h, kind="stable")  # stable: the earliest row leads its bucket
        hs = h[order]
        new = np.concatenate(([True], hs[1:] != hs[:-1]))
        head = order[np.maximum.accumulate(np.where(new, np.arange(n), 0))]
        cand = np.flatnonzero(~new)
        for c in range(0, len(cand), chunk):
            a, b = order[cand[c : c + chunk]], head[cand[c : c + chunk]]
            sim = (sig[a] == sig[b]).mean(axis=1)
            dup[a[sim >= threshold]] = True
    return dup
