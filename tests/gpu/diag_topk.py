"""Diagnostic (not collected by pytest): where the full-vocab top-K departs from the stable order."""

import torch
import triton

from ddtree_runtime.kernels import topk as T


def main() -> None:
    vocab = 248320
    for rows, k in [(480, 16), (15, 256), (15, 64), (120, 64)]:
        gen = torch.Generator(device="cuda").manual_seed(rows + k)
        x = (torch.randn((rows, vocab), device="cuda", generator=gen) * 2).to(torch.bfloat16)
        kc, tile, chunk = T.plan(rows, vocab, k)
        n_chunks = triton.cdiv(vocab, chunk)
        keys = torch.empty((rows, n_chunks, kc), dtype=torch.int64, device="cuda")
        cmax = torch.empty((rows, n_chunks), dtype=torch.float32, device="cuda")
        csum = torch.empty_like(cmax)
        for cap in (4 * kc, kc):
            scratch = torch.empty((rows, n_chunks, cap), dtype=torch.int64, device="cuda")
            T._chunk_kernel[(rows, n_chunks)](
                x, x.stride(0), vocab, chunk, n_chunks, keys, cmax, csum, scratch,
                KC=kc, TILE=tile, CAP=cap, num_warps=8,
            )
            ids_c = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
            bad_chunks = 0
            first = None
            for c in range(n_chunks):
                seg = x[:, c * chunk : (c + 1) * chunk].float()
                ref = torch.sort(seg, dim=-1, descending=True, stable=True).indices[:, :kc] + c * chunk
                n = min(kc, seg.shape[1])
                diff = (ids_c[:, c, :n] != ref[:, :n])
                if diff.any():
                    bad_chunks += 1
                    if first is None:
                        r, j = diff.nonzero()[0].tolist()
                        first = (c, r, j, ids_c[r, c, max(j - 2, 0) : j + 3].tolist(),
                                 ref[r, max(j - 2, 0) : j + 3].tolist(),
                                 x[r, ids_c[r, c, max(j - 2, 0) : j + 3].clamp(0, vocab - 1)].tolist(),
                                 x[r, ref[r, max(j - 2, 0) : j + 3]].tolist())
            _, ids = T.topk_log_probs(x, k, cap=cap)
            want = torch.sort(torch.log_softmax(x.float(), -1), dim=-1, descending=True, stable=True)
            bad = (ids != want.indices[:, :k]).nonzero()
            info = None
            if len(bad):
                r, j = bad[0].tolist()
                lo = max(j - 2, 0)
                info = (r, j, ids[r, lo : j + 3].tolist(), want.indices[r, lo : j + 3].tolist())
            same_set = bool((ids.sort(-1).values == want.indices[:, :k].sort(-1).values).all())
            print(f"rows={rows} k={k} kc={kc} tile={tile} chunk={chunk} n_chunks={n_chunks} cap={cap}: "
                  f"bad_chunks={bad_chunks}/{n_chunks} first_chunk_diff={first} final_bad={len(bad)} "
                  f"same_set={same_set} first_final_diff={info}", flush=True)


if __name__ == "__main__":
    main()
