"""An independent pure-Python Philox4x32-10 and dropout mask, straight from SPEC section 3."""
import struct

MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    c = [counter & MASK32, (counter >> 32) & MASK32, 0, 0]
    k0, k1 = key & MASK32, (key >> 32) & MASK32
    for _ in range(10):
        p0 = 0xD2511F53 * c[0]
        p1 = 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & MASK32, p1 & MASK32, ((p0 >> 32) ^ c[3] ^ k1) & MASK32, p0 & MASK32]
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c


def multiplier(pos, p, seed, offset):
    word = philox4x32_10((offset + pos // 4) % 2**64, seed)[pos % 4]
    u = (word >> 8) * 2.0**-24
    p32 = struct.unpack("f", struct.pack("f", p))[0]  # the comparison is in float32
    return 1.0 / (1.0 - p) if p32 < 1.0 and u >= p32 else 0.0


def dropout_mask(shape, p, seed, offset, global_shape=None, start=(0, 0, 0)):
    """Nested lists of multipliers for a (B, H, L, S) block at `start` of `global_shape` (GH, GL, GS)."""
    batch, heads, queries, keys = shape
    gh, gl, gs = global_shape or (heads, queries, keys)
    hs, qs, ks = start
    return [[[[multiplier(((b * gh + hs + h) * gl + qs + i) * gs + ks + j, p, seed, offset) for j in range(keys)]
              for i in range(queries)] for h in range(heads)] for b in range(batch)]
