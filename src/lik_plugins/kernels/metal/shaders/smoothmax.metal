// Smooth-MaxSim backward for Apple GPUs (the forward is maxsim_forward in MODE_SMOOTH).
//
//     score(q, j) = sum_s tau * logsumexp_t(S[q, j, s, t] / tau),    P = exp(S / tau - lse)
//     dQ[q, s]    = sum_j grad[q, j] sum_t P[q, j, s, t] D[j, t]
//     dD[j, t]    = sum_q grad[q, j] sum_s P[q, j, s, t] Q[q, s]
//
// One kernel serves both gradients: a threadgroup owns FWD_BM "rows" X (query rows for dQ,
// document tokens for dD) and walks "columns" Y (the other side) in FWD_BN tiles.  Per
// tile it recomputes S = X Y^T with simdgroup matrices, forms W = grad * P elementwise,
// and accumulates out^T += Y^T W^T -- [dim, BN] @ [BN, BM] -- in simdgroup matrices that
// stay in registers (each simdgroup owns dim/32 of the components), so every output
// element has one owner: deterministic, no atomics.  Needs dim <= SM_DMAX (the launcher
// sends wider embeddings to the chunked path).  Prelude and conventions: maxsim.metal.

#define SM_DMAX 128                            // largest embedding served
#define SM_HBLOCKS (SM_DMAX / 8 / LIK_SIMDGROUPS) // 8-wide component blocks per simdgroup

kernel void smooth_backward(
    device const elem_t* X       [[buffer(0)]],   // rows side: Q (dQ) or D (dD)
    device const elem_t* Y       [[buffer(1)]],   // columns side: D (dQ) or Q (dD)
    device const float* lse      [[buffer(2)]],   // [Nq, NJ, Lq]
    device const float* grad     [[buffer(3)]],   // [Nq, NJ]
    device float* out            [[buffer(4)]],   // X's shape, fp32
    constant long* shape         [[buffer(5)]],   // nq, lq, nj, ld, dim, queries per group
    constant long* flags         [[buffer(6)]],   // cross, rows_are_docs
    constant float& tau          [[buffer(7)]],
    uint3 group                  [[threadgroup_position_in_grid]],
    uint tid                     [[thread_index_in_threadgroup]],
    uint sg                      [[simdgroup_index_in_threadgroup]])
{
    const long nq = shape[0], lq = shape[1], nj = shape[2], ld = shape[3], dim = shape[4];
    const long qpg = shape[5];
    const bool cross = flags[0] != 0, rows_are_docs = flags[1] != 0;
    const long dpad = (dim + 7) / 8 * 8;
    const float inv_tau = 1.0f / tau;

    // Rows [row_begin, row_end) of X this threadgroup owns, and the column segments of Y:
    //   dQ: rows = queries q0..q1 (walked in FWD_BM blocks); one segment per document j
    //       (cross: D[j]; candidates: D[q0, j]), Ld columns each.
    //   dD: rows = FWD_BM tokens of unit group.y (cross: document j; candidates: pair
    //       q * NJ + k); one segment: cross -> all Nq * Lq query rows, candidates -> q's rows.
    long row_begin, row_end, unit = 0, q0 = 0;
    if (rows_are_docs) {
        unit = group.y;
        row_begin = unit * ld + long(group.x) * FWD_BM;
        row_end = (long(group.x) * FWD_BM + FWD_BM < ld) ? row_begin + FWD_BM : unit * ld + ld;
    } else {
        q0 = long(group.x) * qpg;
        row_begin = q0 * lq;
        row_end = ((q0 + qpg < nq) ? q0 + qpg : nq) * lq;
    }
    const long n_segments = rows_are_docs ? 1 : nj;

    threadgroup float x_tile[FWD_BM * FWD_BK];      // [rows][components]
    threadgroup float yt_tile[SM_DMAX * FWD_BN];    // [components][columns]: Y transposed;
                                                    // at the end: out^T [components][rows]
    threadgroup float s_tile[FWD_BM * FWD_BN];      // similarities [rows][columns]
    threadgroup float wt_tile[FWD_BN * FWD_BM];     // W transposed [columns][rows]

    for (long r0 = row_begin; r0 < row_end; r0 += FWD_BM) {
        const long nrows = (row_end - r0 < FWD_BM) ? row_end - r0 : FWD_BM;
        simdgroup_float8x8 acc[SM_HBLOCKS][FWD_BM / 8];   // out^T blocks [h-block][row-block]
        for (uint i = 0; i < SM_HBLOCKS; ++i) {
            for (uint rb = 0; rb < FWD_BM / 8; ++rb) {
                acc[i][rb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            }
        }

        for (long seg = 0; seg < n_segments; ++seg) {
            long col_begin, col_end;
            if (rows_are_docs) {
                col_begin = cross ? 0 : (unit / nj) * lq;
                col_end = cross ? nq * lq : col_begin + lq;
            } else {
                col_begin = cross ? seg * ld : (q0 * nj + seg) * ld;
                col_end = col_begin + ld;
            }
            for (long c0 = col_begin; c0 < col_end; c0 += FWD_BN) {
                const long ncols = (col_end - c0 < FWD_BN) ? col_end - c0 : FWD_BN;
                // stage Y^T [dpad, BN] for the whole embedding, zero padded
                for (uint i = tid; i < SM_DMAX * FWD_BN; i += LIK_THREADS) {
                    const long c = i / SM_DMAX, h = i % SM_DMAX;
                    float v = 0.0f;
                    if (c < ncols && h < dim) {
                        v = float(Y[(c0 + c) * dim + h]);
                    }
                    yt_tile[h * FWD_BN + c] = v;
                }
                // S = X Y^T over BK-wide slices
                simdgroup_float8x8 s_acc[FWD_BN / 8];
                for (uint c = 0; c < FWD_BN / 8; ++c) {
                    s_acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
                }
                for (long k0 = 0; k0 < dpad; k0 += FWD_BK) {
                    for (uint i = tid; i < FWD_BM * FWD_BK; i += LIK_THREADS) {
                        const long r = i / FWD_BK, k = i % FWD_BK;
                        float v = 0.0f;
                        if (r < nrows && k0 + k < dim) {
                            v = float(X[(r0 + r) * dim + k0 + k]);
                        }
                        x_tile[i] = v;
                    }
                    threadgroup_barrier(mem_flags::mem_threadgroup);
                    for (long kk = 0; kk < FWD_BK && k0 + kk < dpad; kk += 8) {
                        simdgroup_float8x8 a;
                        simdgroup_load(a, x_tile + sg * 8 * FWD_BK + kk, FWD_BK);
                        for (uint c = 0; c < FWD_BN / 8; ++c) {
                            simdgroup_float8x8 b;
                            simdgroup_load(b, yt_tile + (k0 + kk) * FWD_BN + c * 8, FWD_BN);
                            simdgroup_multiply_accumulate(s_acc[c], a, b, s_acc[c]);
                        }
                    }
                    threadgroup_barrier(mem_flags::mem_threadgroup);
                }
                for (uint c = 0; c < FWD_BN / 8; ++c) {
                    simdgroup_store(s_acc[c], s_tile + sg * 8 * FWD_BN + c * 8, FWD_BN);
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);
                // W^T[c][r] = grad * exp(S / tau - lse) for the (query row, document) of (r, c)
                for (uint i = tid; i < FWD_BM * FWD_BN; i += LIK_THREADS) {
                    const long r = i / FWD_BN, c = i % FWD_BN;
                    float w = 0.0f;
                    if (r < nrows && c < ncols) {
                        long pair, s;
                        if (rows_are_docs) {
                            const long qrow = c0 + c, q = qrow / lq;
                            s = qrow - q * lq;
                            pair = cross ? q * nj + unit : unit;
                        } else {
                            const long qrow = r0 + r, q = qrow / lq;
                            s = qrow - q * lq;
                            pair = q * nj + seg;
                        }
                        const float p = metal::precise::exp(s_tile[r * FWD_BN + c] * inv_tau - lse[pair * lq + s]);
                        w = grad[pair] * p;
                    }
                    wt_tile[c * FWD_BM + r] = w;
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);
                // out^T [dim, BM] += Y^T [dim, BN] @ W^T [BN, BM]; simdgroup sg owns h-blocks sg + 4 i
                for (uint i = 0; i < SM_HBLOCKS; ++i) {
                    const long hb = sg + LIK_SIMDGROUPS * i;
                    if (hb * 8 >= dpad) {
                        break;
                    }
                    for (uint cb = 0; cb < FWD_BN / 8; ++cb) {
                        simdgroup_float8x8 a;
                        simdgroup_load(a, yt_tile + hb * 8 * FWD_BN + cb * 8, FWD_BN);
                        for (uint rb = 0; rb < FWD_BM / 8; ++rb) {
                            simdgroup_float8x8 b;
                            simdgroup_load(b, wt_tile + cb * 8 * FWD_BM + rb * 8, FWD_BM);
                            simdgroup_multiply_accumulate(acc[i][rb], a, b, acc[i][rb]);
                        }
                    }
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);   // yt/wt are restaged next tile
            }
        }

        // out^T blocks -> threadgroup (reusing yt_tile as [dim][BM]) -> out rows
        for (uint i = 0; i < SM_HBLOCKS; ++i) {
            const long hb = sg + LIK_SIMDGROUPS * i;
            if (hb * 8 >= dpad) {
                break;
            }
            for (uint rb = 0; rb < FWD_BM / 8; ++rb) {
                simdgroup_store(acc[i][rb], yt_tile + hb * 8 * FWD_BM + rb * 8, FWD_BM);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint i = tid; i < FWD_BM * SM_DMAX; i += LIK_THREADS) {
            const long r = i / SM_DMAX, h = i % SM_DMAX;
            if (r < nrows && h < dim) {
                out[(r0 + r) * dim + h] = yt_tile[h * FWD_BM + r];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}
