// MaxSim kernels for Apple GPUs (Metal Shading Language).
//
// Compiled at run time by torch.mps.compile_shader (lik_plugins/kernels/metal/launch.py).
// launch.library_source() puts a prelude in front of this file:
//     #include <metal_stdlib>
//     using namespace metal;
//     typedef <half | bfloat | float> elem_t;      // the input dtype
// so one library is built per input dtype.  Every product accumulates in fp32.
//
// The same text is compiled as C++ by the emulator (tools/metal_emulator/emulate.py),
// which is why the kernels keep to a subset both compilers accept:
//   * threadgroup memory is declared only at kernel scope (never as a helper parameter);
//   * maths go through metal::-qualified functions; NaN tests are written `v != v`;
//   * tile sizes are #defines, scalar arguments are `constant long*` / `constant float&`
//     (torch passes Python ints as int64 and floats as fp32, lists as arrays);
//   * buffer indices follow the argument order (torch binds argument i to buffer(i)).
//
// Layouts (row-major, contiguous):
//   Q       [Nq, Lq, d]                       query tokens
//   D       cross: [NJ, Ld, d]; candidates: [Nq, NJ, Ld, d] (pairs are candidates with NJ = 1)
//   argmax  [Nq, NJ, Lq] int32, the winning doc token of each query row, -1 for none
//   scores  [Nq, NJ] fp32

#define LIK_THREADS 128          // threads per threadgroup: 4 simdgroups of 32
#define LIK_SIMDGROUPS 4
#define FWD_BM 32                // query rows per tile (8 per simdgroup)
#define FWD_BN 32                // document tokens per tile
#define FWD_BK 32                // embedding components staged per step
#define GQ_PER_LANE 4            // grad_Q: components per lane per pass (128 per simdgroup)
#define GD_TOKENS 32             // grad_D: document tokens owned by one threadgroup
#define GD_COLS 128              // grad_D: embedding components accumulated per pass
#define NORM_EPS 1e-12f

#define MODE_MAX 0               // maxsim_forward: hard max over document tokens
#define MODE_SMOOTH 1            // maxsim_forward: tau * logsumexp(S / tau) (no masks, no norm)

// ---------------------------------------------------------------------------------------
// inverse_norms: out[r] = 1 / max(||X[r]||, eps), one simdgroup per row.
kernel void inverse_norms(
    device const elem_t* X       [[buffer(0)]],   // [rows, dim]
    device float* out            [[buffer(1)]],   // [rows]
    constant long* shape         [[buffer(2)]],   // rows, dim
    uint3 group                  [[threadgroup_position_in_grid]],
    uint lane                    [[thread_index_in_simdgroup]],
    uint sg                      [[simdgroup_index_in_threadgroup]])
{
    const long rows = shape[0], dim = shape[1];
    const long row = long(group.x) * LIK_SIMDGROUPS + sg;
    if (row >= rows) {
        return;   // uniform over the simdgroup: no lane of it reaches the simd_sum
    }
    float sq = 0.0f;
    for (long h = lane; h < dim; h += 32) {
        const float x = float(X[row * dim + h]);
        sq += x * x;
    }
    const float total = simd_sum(sq);
    if (lane == 0) {
        out[row] = 1.0f / metal::max(metal::sqrt(total), NORM_EPS);
    }
}

// ---------------------------------------------------------------------------------------
// project_out_norm: the Jacobian of x / ||x|| applied in place to g = dL/dx_hat:
//     g <- (g - <g, x_hat> x_hat) / ||x||,   x_hat = x * inv.   One simdgroup per row.
kernel void project_out_norm(
    device float* g              [[buffer(0)]],   // [rows, dim], in place
    device const elem_t* X       [[buffer(1)]],   // [rows, dim]
    device const float* inv      [[buffer(2)]],   // [rows]
    constant long* shape         [[buffer(3)]],   // rows, dim
    uint3 group                  [[threadgroup_position_in_grid]],
    uint lane                    [[thread_index_in_simdgroup]],
    uint sg                      [[simdgroup_index_in_threadgroup]])
{
    const long rows = shape[0], dim = shape[1];
    const long row = long(group.x) * LIK_SIMDGROUPS + sg;
    if (row >= rows) {
        return;
    }
    const float r = inv[row];
    float part = 0.0f;
    for (long h = lane; h < dim; h += 32) {
        part += g[row * dim + h] * float(X[row * dim + h]) * r;
    }
    const float radial = simd_sum(part);
    for (long h = lane; h < dim; h += 32) {   // each lane rewrites only the components it read
        const float x_hat = float(X[row * dim + h]) * r;
        g[row * dim + h] = (g[row * dim + h] - radial * x_hat) * r;
    }
}

// ---------------------------------------------------------------------------------------
// maxsim_forward: one threadgroup per (query group, document).
//
// Cross product: a group is `shape[5]` whole queries (as many as fit in FWD_BM rows), so
// one document tile serves several queries' tokens.  Candidates: one query per group,
// document = the query's own candidate.  Queries longer than FWD_BM rows are walked in
// row blocks.  Per document tile, the [FWD_BM, FWD_BN] similarity block is a simdgroup
// matrix product over FWD_BK-wide slices of the embedding (each simdgroup owns 8 rows);
// thread r < FWD_BM then folds its row of the block into a running (max, argmax) -- or,
// in MODE_SMOOTH, into an online log-sum-exp.  Query sums are taken in row order by one
// thread per query, so scores are deterministic and need no atomics.
kernel void maxsim_forward(
    device const elem_t* Q       [[buffer(0)]],
    device const elem_t* D       [[buffer(1)]],
    device const uchar* q_mask   [[buffer(2)]],   // [Nq, Lq], read if has_q_mask
    device const uchar* d_mask   [[buffer(3)]],   // D's shape without d, read if has_d_mask
    device const float* q_inv    [[buffer(4)]],   // [Nq * Lq] inverse norms, read if normalize
    device const float* d_inv    [[buffer(5)]],   // [D rows] inverse norms, read if normalize
    device float* scores         [[buffer(6)]],   // [Nq, NJ]
    device int* argmax           [[buffer(7)]],   // [Nq, NJ, Lq], written if save_argmax
    device float* lse            [[buffer(8)]],   // [Nq, NJ, Lq], written in MODE_SMOOTH
    constant long* shape         [[buffer(9)]],   // nq, lq, nj, ld, dim, queries per group
    constant long* flags         [[buffer(10)]],  // cross, has_q_mask, has_d_mask, normalize,
                                                  // zero_mode, save_argmax, mode
    constant float& tau          [[buffer(11)]],  // MODE_SMOOTH temperature
    uint3 group                  [[threadgroup_position_in_grid]],
    uint tid                     [[thread_index_in_threadgroup]],
    uint sg                      [[simdgroup_index_in_threadgroup]])
{
    const long nq = shape[0], lq = shape[1], nj = shape[2], ld = shape[3], dim = shape[4];
    const long qpg = shape[5];
    const bool cross = flags[0] != 0, has_q_mask = flags[1] != 0, has_d_mask = flags[2] != 0;
    const bool normalize = flags[3] != 0, zero_mode = flags[4] != 0, save_argmax = flags[5] != 0;
    const bool smooth = flags[6] == MODE_SMOOTH;

    const long j = group.y;
    const long q0 = long(group.x) * qpg;
    const long q1 = (q0 + qpg < nq) ? q0 + qpg : nq;
    const long row_end = q1 * lq;
    const long drow0 = cross ? j * ld : (q0 * nj + j) * ld;   // first token row of the document
    const float inv_tau = 1.0f / tau;

    threadgroup float q_tile[FWD_BM * FWD_BK];    // [rows][components]
    threadgroup float dt_tile[FWD_BK * FWD_BN];   // [components][tokens]: D transposed
    threadgroup float s_tile[FWD_BM * FWD_BN];    // similarities of the tile
    threadgroup float d_scale[FWD_BN];            // the tile's token inverse norms (or 1)
    threadgroup int d_state[FWD_BN];              // 1 valid, 0 masked, -1 past the end
    threadgroup float row_value[FWD_BM];

    float query_sum = 0.0f;   // thread g < q1 - q0 accumulates query q0 + g

    for (long r0 = q0 * lq; r0 < row_end; r0 += FWD_BM) {
        const long nrows = (row_end - r0 < FWD_BM) ? row_end - r0 : FWD_BM;
        // state of row r0 + tid, owned by thread tid < nrows
        float best = -INFINITY;
        int best_t = -1;
        bool saw_masked = false;
        float run_max = -INFINITY, run_sum = 0.0f;   // online log-sum-exp of S / tau

        for (long t0 = 0; t0 < ld; t0 += FWD_BN) {
            simdgroup_float8x8 acc[FWD_BN / 8];
            for (uint c = 0; c < FWD_BN / 8; ++c) {
                acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            }
            for (long k0 = 0; k0 < dim; k0 += FWD_BK) {
                // stage zero-padded slices: Q [BM, BK] and D transposed [BK, BN], as fp32
                for (uint i = tid; i < FWD_BM * FWD_BK; i += LIK_THREADS) {
                    const long r = i / FWD_BK, k = i % FWD_BK;
                    float v = 0.0f;
                    if (r < nrows && k0 + k < dim) {
                        v = float(Q[(r0 + r) * dim + k0 + k]);
                    }
                    q_tile[i] = v;
                }
                for (uint i = tid; i < FWD_BN * FWD_BK; i += LIK_THREADS) {
                    const long t = i / FWD_BK, k = i % FWD_BK;
                    float v = 0.0f;
                    if (t0 + t < ld && k0 + k < dim) {
                        v = float(D[(drow0 + t0 + t) * dim + k0 + k]);
                    }
                    dt_tile[k * FWD_BN + t] = v;
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);
                // [8, BK] @ [BK, BN] -> this simdgroup's 8 rows of the tile
                for (uint kk = 0; kk < FWD_BK; kk += 8) {
                    simdgroup_float8x8 a;
                    simdgroup_load(a, q_tile + sg * 8 * FWD_BK + kk, FWD_BK);
                    for (uint c = 0; c < FWD_BN / 8; ++c) {
                        simdgroup_float8x8 b;
                        simdgroup_load(b, dt_tile + kk * FWD_BN + c * 8, FWD_BN);
                        simdgroup_multiply_accumulate(acc[c], a, b, acc[c]);
                    }
                }
                threadgroup_barrier(mem_flags::mem_threadgroup);
            }
            for (uint c = 0; c < FWD_BN / 8; ++c) {
                simdgroup_store(acc[c], s_tile + sg * 8 * FWD_BN + c * 8, FWD_BN);
            }
            if (tid < FWD_BN) {
                const long t = t0 + tid;
                d_scale[tid] = (normalize && t < ld) ? d_inv[drow0 + t] : 1.0f;
                d_state[tid] = (t >= ld) ? -1 : ((!has_d_mask || d_mask[drow0 + t] != 0) ? 1 : 0);
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);

            if (tid < nrows) {
                const float q_scale = normalize ? q_inv[r0 + tid] : 1.0f;
                for (uint c = 0; c < FWD_BN; ++c) {
                    const int state = d_state[c];
                    if (state < 0) {
                        break;
                    }
                    const float v = s_tile[tid * FWD_BN + c] * q_scale * d_scale[c];
                    if (smooth) {
                        const float x = v * inv_tau;
                        if (x > run_max) {
                            run_sum = run_sum * metal::precise::exp(run_max - x) + 1.0f;
                            run_max = x;
                        } else {
                            run_sum += metal::precise::exp(x - run_max);
                        }
                    } else if (state == 0) {
                        saw_masked = true;
                    } else if (v > best || (v != v && best == best)) {   // a NaN wins, as in torch.max
                        best = v;
                        best_t = int(t0 + c);
                    }
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);   // s_tile is rewritten next tile
        }

        if (tid < nrows) {
            const long row = r0 + tid;
            const long q = row / lq, s = row - (row / lq) * lq;
            const long out = (q * nj + j) * lq + s;
            float value;
            if (smooth) {
                const float row_lse = run_max + metal::precise::log(run_sum);
                lse[out] = row_lse;
                value = tau * row_lse;
            } else {
                const bool q_valid = !has_q_mask || q_mask[row] != 0;
                // zero mode: a masked token's similarity is 0 and beats a negative best
                const bool wins = q_valid && best_t >= 0 && !(zero_mode && saw_masked && best < 0.0f);
                value = wins ? best : 0.0f;
                if (save_argmax) {
                    argmax[out] = wins ? best_t : -1;
                }
            }
            row_value[tid] = value;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid < q1 - q0) {
            const long first = (q0 + tid) * lq, last = first + lq;
            for (long r = (first > r0 ? first : r0); r < last && r < r0 + nrows; ++r) {
                query_sum += row_value[r - r0];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // row_value is rewritten next block
    }
    if (tid < q1 - q0) {
        scores[(q0 + tid) * nj + j] = query_sum;
    }
}

// ---------------------------------------------------------------------------------------
// maxsim_grad_q: grad_Q gathered through the argmax, one simdgroup per query row:
//     g_hat[q, s] = sum_j grad[q, j] * D_hat[winner(q, j, s)]        (j in order: deterministic)
// Written in fp32, before the normalisation Jacobian (project_out_norm applies it).
kernel void maxsim_grad_q(
    device const elem_t* D       [[buffer(0)]],
    device const float* d_inv    [[buffer(1)]],   // [D rows], read if normalize
    device const int* argmax     [[buffer(2)]],   // [Nq, NJ, Lq]
    device const float* grad     [[buffer(3)]],   // [Nq, NJ]
    device float* grad_q         [[buffer(4)]],   // [Nq * Lq, dim]
    constant long* shape         [[buffer(5)]],   // nq, lq, nj, ld, dim
    constant long* flags         [[buffer(6)]],   // cross, normalize
    uint3 group                  [[threadgroup_position_in_grid]],
    uint lane                    [[thread_index_in_simdgroup]],
    uint sg                      [[simdgroup_index_in_threadgroup]])
{
    const long nq = shape[0], lq = shape[1], nj = shape[2], ld = shape[3], dim = shape[4];
    const bool cross = flags[0] != 0, normalize = flags[1] != 0;
    const long row = long(group.x) * LIK_SIMDGROUPS + sg;
    if (row >= nq * lq) {
        return;
    }
    const long q = row / lq, s = row - (row / lq) * lq;
    for (long h0 = 0; h0 < dim; h0 += 32 * GQ_PER_LANE) {
        float acc[GQ_PER_LANE];
        for (uint i = 0; i < GQ_PER_LANE; ++i) {
            acc[i] = 0.0f;
        }
        for (long jj = 0; jj < nj; ++jj) {
            const int w = argmax[(q * nj + jj) * lq + s];
            if (w < 0) {
                continue;
            }
            const long drow = (cross ? jj * ld : (q * nj + jj) * ld) + w;
            const float weight = grad[q * nj + jj] * (normalize ? d_inv[drow] : 1.0f);
            for (uint i = 0; i < GQ_PER_LANE; ++i) {
                const long h = h0 + lane + 32 * i;
                if (h < dim) {
                    acc[i] += weight * float(D[drow * dim + h]);
                }
            }
        }
        for (uint i = 0; i < GQ_PER_LANE; ++i) {
            const long h = h0 + lane + 32 * i;
            if (h < dim) {
                grad_q[row * dim + h] = acc[i];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// maxsim_grad_d: destination-owned grad_D, deterministic, no atomics.
//
// One threadgroup owns GD_TOKENS consecutive tokens of one document (cross: document
// group.y; candidates: pair group.y = q * NJ + k).  It walks every query row that could
// have picked one of them (cross: all Nq * Lq rows; candidates: the Lq rows of q) in row
// order, staging LIK_THREADS argmax entries at a time; an entry that names token t is
// added by simdgroup t % 4 only, each lane adding its own components, into a threadgroup
// accumulator [GD_TOKENS, GD_COLS].  Every accumulator element therefore has exactly one
// writer, and the sum order is the row order.  Written in fp32 before the Jacobian.
kernel void maxsim_grad_d(
    device const elem_t* Q       [[buffer(0)]],
    device const float* q_inv    [[buffer(1)]],   // [Nq * Lq], read if normalize
    device const int* argmax     [[buffer(2)]],   // [Nq, NJ, Lq]
    device const float* grad     [[buffer(3)]],   // [Nq, NJ]
    device float* grad_d         [[buffer(4)]],   // D's shape, fp32
    constant long* shape         [[buffer(5)]],   // nq, lq, nj, ld, dim
    constant long* flags         [[buffer(6)]],   // cross, normalize
    uint3 group                  [[threadgroup_position_in_grid]],
    uint tid                     [[thread_index_in_threadgroup]],
    uint lane                    [[thread_index_in_simdgroup]],
    uint sg                      [[simdgroup_index_in_threadgroup]])
{
    const long nq = shape[0], lq = shape[1], nj = shape[2], ld = shape[3], dim = shape[4];
    const bool cross = flags[0] != 0, normalize = flags[1] != 0;
    const long unit = group.y;                          // document (cross) or pair (candidates)
    const long t0 = long(group.x) * GD_TOKENS;          // first owned token
    const long drow0 = unit * ld;                       // first token row of the unit
    // query rows that may point here: cross -> all rows; candidates -> rows of q = unit / NJ
    const long e_begin = cross ? 0 : (unit / nj) * lq;
    const long e_end = cross ? nq * lq : e_begin + lq;

    threadgroup float acc[GD_TOKENS * GD_COLS];
    threadgroup int e_token[LIK_THREADS];     // owned token index, or -1
    threadgroup int e_row[LIK_THREADS];       // query row
    threadgroup float e_weight[LIK_THREADS];  // grad[q, j] (times the row's inverse norm)

    for (long h0 = 0; h0 < dim; h0 += GD_COLS) {
        for (uint i = tid; i < GD_TOKENS * GD_COLS; i += LIK_THREADS) {
            acc[i] = 0.0f;
        }
        for (long e0 = e_begin; e0 < e_end; e0 += LIK_THREADS) {
            threadgroup_barrier(mem_flags::mem_threadgroup);   // last chunk consumed, acc zeroed
            const long e = e0 + tid;
            int token = -1;
            if (e < e_end) {
                const long q = e / lq, s = e - (e / lq) * lq;
                const long pair = cross ? q * nj + unit : unit;
                const int w = argmax[pair * lq + s];
                if (w >= t0 && w < t0 + GD_TOKENS) {
                    token = int(w - t0);
                    e_row[tid] = int(e);
                    e_weight[tid] = grad[pair] * (normalize ? q_inv[e] : 1.0f);
                }
            }
            e_token[tid] = token;
            threadgroup_barrier(mem_flags::mem_threadgroup);
            const long n = (e_end - e0 < LIK_THREADS) ? e_end - e0 : LIK_THREADS;
            for (long i = 0; i < n; ++i) {
                const int token_i = e_token[i];
                if (token_i < 0 || token_i % LIK_SIMDGROUPS != int(sg)) {
                    continue;
                }
                const float weight = e_weight[i];
                const long qrow = e_row[i];
                for (uint c = lane; c < GD_COLS; c += 32) {
                    if (h0 + c < dim) {
                        acc[token_i * GD_COLS + c] += weight * float(Q[qrow * dim + h0 + c]);
                    }
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint i = tid; i < GD_TOKENS * GD_COLS; i += LIK_THREADS) {
            const long t = t0 + i / GD_COLS, h = h0 + i % GD_COLS;
            if (t < ld && h < dim) {
                grad_d[(drow0 + t) * dim + h] = acc[i];
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // acc is zeroed again next pass
    }
}
