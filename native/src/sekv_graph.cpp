// SeKV's decode step, and its prefill chunk, as one ggml graph of stock ops (so the same graph can run on any
// ggml backend).
//
// Per layer: q/k/v from llama.cpp's (quantized) weights, RoPE; the new K/V rows are written into the
// exact rows; routing scores every span by its coarse attention logit + log|S| (max over the KV group's
// query heads, and over a chunk's tokens) or, with the learned router, by q'.k'/sqrt(d') + log|S| where it
// passes the head's threshold; a hard top-k picks the spans to zoom into (one choice per chunk, as the torch
// engine makes it); their rows are rebuilt from the SVD factors (get_rows + mul_mat), RoPE'd at their
// original positions; one softmax runs over exact rows, pinned rows (spans a
// question attended to, kept whole for its answer), summary rows (+log|S|; the zoomed and pinned spans' ones
// masked) and the rebuilt rows. Pinned spans are never routed. A sliding-window layer (Gemma 3) only writes its
// rows into its ring and attends to the window there; the layer shape around attention (norms, scales, gate) is
// read from the model's hyper-parameters.
//
// A chunk's T tokens are laid out as G * T query rows per KV head ([D, G, T, KV], query head fastest), so every
// op that serves one token's G query heads serves the chunk unchanged, and a block of tokens is a slice.
#include "sekv_internal.h"

#include "llama-model.h"

#include <algorithm>
#include <numeric>
#include <cmath>
#include <tuple>
#include <utility>

namespace {

struct step_builder {
    sekv_memory * mem;
    ggml_context * ctx;
    const sekv_model * m;
    int64_t D, H, KV, G, n_rows;  // G: query rows per KV head (a chunk's tokens times the query heads of a group)
    int64_t T = 1;                // tokens (query heads per KV head: G / T)

    // RoPE of layer il (a sliding-window layer has its own base and scale)
    ggml_tensor * rope(ggml_tensor * x, ggml_tensor * positions, ggml_tensor * factors, int il) const {
        const bool local = m->local[il] != 0;
        return ggml_rope_ext(ctx, x, positions, factors, (int) D, m->rope_type, m->n_ctx_orig,
                             local ? m->rope_base_swa : m->rope_base, local ? m->rope_scale_swa : m->rope_scale,
                             0.0f, 1.0f, m->beta_fast, m->beta_slow);
    }

    // a [N, G, KV] slice [from, from + n) along dim 0 (mul_mat reads strided rows of its second operand)
    ggml_tensor * rows(ggml_tensor * a, int64_t from, int64_t n) const {
        return ggml_view_3d(ctx, a, n, a->ne[1], a->ne[2], a->nb[1], a->nb[2], from * a->nb[0]);
    }

    // max over dim 1 (the query heads of a KV group): [S, G, KV] -> [S, KV]
    ggml_tensor * max_over_group(ggml_tensor * a) const {
        ggml_tensor * best = ggml_pool_2d(ctx, a, GGML_OP_POOL_MAX, 1, (int) a->ne[1], 1, (int) a->ne[1], 0, 0);
        return ggml_reshape_2d(ctx, best, a->ne[0], a->ne[2]);
    }

    // the chosen spans' entries of a raw table whose KV heads are stacked, [n, slots, KV] -> f32 [n, k, KV]
    ggml_tensor * raw_rows(ggml_tensor * table, ggml_tensor * slot_of_span, ggml_tensor * chosen, int64_t k) const {
        ggml_tensor * slots = ggml_reshape_2d(ctx, ggml_get_rows(ctx, slot_of_span, chosen), k, KV);
        return ggml_get_rows(ctx, table, slots);
    }

    // The learned router's choice: q_pre [D, G, KV] (before RoPE) -> chosen spans i32 [k, KV] and whether
    // each passed its head's threshold f32 [1, k, KV]. A span failing every head's threshold scores
    // BELOW (finite, so no inf * 0 below); the top-k takes it only when fewer than k passed. taken i32 [n, KV]:
    // spans already chosen (by the training-free rule of the union), scored below every other, or nullptr.
    std::pair<ggml_tensor *, ggml_tensor *> learned_route(int il, ggml_tensor * q_pre, ggml_tensor * route_bias,
                                                          int64_t k, ggml_tensor * taken) const {
        constexpr float BELOW = 1e30f;
        const sekv_layer_tensors & t = mem->layers[il];
        const int64_t dp = mem->router_dim, S = mem->params.n_spans;
        ggml_tensor * proj = ggml_view_2d(ctx, m->router_q, D, dp, m->router_q->nb[1], il * m->router_q->nb[2]);
        ggml_tensor * qp = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, proj, ggml_reshape_2d(ctx, q_pre, D, G * KV)), dp, G, KV);
        ggml_tensor * logits = ggml_scale(ctx, ggml_mul_mat(ctx, t.route_k, qp), 1.0f / std::sqrt((float) dp));
        logits = ggml_add(ctx, logits, route_bias);  // [S, G, KV]
        const int64_t Gh = G / T;  // thresholds are per query head, the same for every token of a chunk
        const size_t f = m->router_thr->nb[0];
        ggml_tensor * thr = ggml_view_4d(ctx, m->router_thr, 1, Gh, 1, KV, f, Gh * f, Gh * f, il * m->router_thr->nb[1]);
        ggml_tensor * passed = ggml_reshape_3d(ctx, ggml_step(ctx, ggml_sub(ctx, ggml_reshape_4d(ctx, logits, S, Gh, T, KV), thr)),
                                               S, G, KV);
        ggml_tensor * score = max_over_group(ggml_add(ctx, logits, ggml_scale_bias(ctx, passed, BELOW, -BELOW)));
        if (taken != nullptr) {
            ggml_tensor * out = ggml_reshape_3d(ctx, filled(taken->ne[0] * KV, -100.0f * BELOW), 1, taken->ne[0], KV);
            score = ggml_reshape_2d(ctx, ggml_set_rows(ctx, ggml_reshape_3d(ctx, ggml_cont(ctx, score), 1, S, KV), out, taken), S, KV);
        }
        ggml_tensor * chosen = ggml_top_k(ctx, score, (int) k);  // i32 [k, KV]
        ggml_tensor * best = ggml_get_rows(ctx, ggml_reshape_3d(ctx, score, 1, S, KV), chosen);  // [1, k, KV]
        ggml_tensor * ok = ggml_step(ctx, ggml_scale_bias(ctx, best, 1.0f, 0.1f * BELOW));
        return {chosen, ok};
    }

    // A layer's zoom for a step or a chunk: the spans chosen from all its query rows and what reading them
    // needs, made once for every query block.
    struct zoom_set {
        int64_t k = 0;                       // spans per KV head (0: none routed)
        ggml_tensor * zk = nullptr;          // the zoomed spans' keys, rotated [D, l * k, KV]
        ggml_tensor * zvt = nullptr;         // their values, transposed [l * k, D, KV] (a decode step)
        ggml_tensor * zv = nullptr;          // their values as rows [D, l * k, KV] (a chunk)
        ggml_tensor * zmask = nullptr;       // padding and empty slots: 0 / -inf [l * k, 1, KV]
        ggml_tensor * coarse_bias = nullptr; // each summary row's bias [S, 1, KV], zoomed and pinned spans out
    };


    // Route (q scaled [D, G, KV], q_pre before RoPE) and gather the zoomed spans' rows.
    zoom_set zoom(int il, ggml_tensor * q, ggml_tensor * q_pre, ggml_tensor ** zoom_out, ggml_tensor ** passed_out) const {
        const sekv_layer_tensors & t = mem->layers[il];
        const int64_t S = mem->params.n_spans, l = mem->params.span_rows, R = mem->params.rank;
        zoom_set z;
        ggml_tensor * span_bias = mem->coarse_bias, * route_bias = mem->route_bias;
        if (t.n_pinned_spans > 0) {
            span_bias = ggml_add(ctx, span_bias, ggml_reshape_3d(ctx, t.pin_bias, 1, S, 1));
            route_bias = ggml_add(ctx, route_bias, t.pin_bias);
        }
        ggml_tensor * coarse_bias = ggml_repeat_4d(ctx, span_bias, 1, S, KV, 1);
        // the pinned spans leave fewer to route, so a top-k never has to take a masked one
        z.k = std::min<int64_t>(mem->params.zoom_k, S - t.n_pinned_spans);
        if (z.k <= 0) {
            z.k = 0;
            z.coarse_bias = ggml_reshape_3d(ctx, ggml_cont(ctx, coarse_bias), S, 1, KV);
            return z;
        }
        const int64_t k = z.k;
        ggml_tensor * chosen = nullptr, * ok = nullptr;
        // the training-free rule: each span's coarse logit + log|S|, the most any query row gives it
        auto by_attention = [&](int64_t n) {
            return ggml_top_k(ctx, max_over_group(ggml_add(ctx, ggml_mul_mat(ctx, t.sk, q), route_bias)), (int) n);  // i32 [n, KV]
        };
        if (mem->params.router == 2) {  // the union: half the pool by the rule, the rest by the learned router
            const int64_t first = (k + 1) / 2;
            ggml_tensor * ruled = by_attention(first);
            if (k > first) {
                std::tie(chosen, ok) = learned_route(il, q_pre, route_bias, k - first, ruled);
                chosen = ggml_concat(ctx, ruled, chosen, 0);
                ok = ggml_concat(ctx, ggml_reshape_3d(ctx, filled(first * KV, 1.0f), 1, first, KV), ok, 1);
            } else {
                chosen = ruled;
            }
        } else if (mem->params.router) {
            std::tie(chosen, ok) = learned_route(il, q_pre, route_bias, k, nullptr);
        } else {
            chosen = by_attention(k);
        }
        if (ok != nullptr) {
            ggml_set_output(ok);
            *passed_out = ok;
        }
        ggml_set_output(chosen);
        *zoom_out = chosen;
        // Zoomed rows, gathered once into dense tensors that every query row of the chunk reads with one matmul
        // per KV head: a factored span's rows are rebuilt (U W, then RoPE at their own positions); a raw span's
        // rows are copied from the host table. A span lies in one table and reads the other's zero slot: the two
        // gathers add up.
        ggml_tensor * zk = nullptr, * zv = nullptr;  // keys [D, l * k, KV]; values [l, D, k * KV]
        if (t.n_factored[0] > 0) {
            ggml_tensor * f = ggml_reshape_2d(ctx, ggml_get_rows(ctx, t.k_fslot, chosen), k, KV);
            ggml_tensor * u = ggml_reshape_3d(ctx, ggml_get_rows(ctx, t.uk, f), R, l, k * KV);
            ggml_tensor * w = ggml_reshape_3d(ctx, ggml_get_rows(ctx, t.wk, f), R, D, k * KV);
            ggml_tensor * zpos = ggml_reshape_1d(ctx, ggml_get_rows(ctx, mem->row_pos, chosen), l * k * KV);
            ggml_tensor * rebuilt = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, w, u), D, 1, l * k * KV);
            zk = ggml_reshape_3d(ctx, rope(rebuilt, zpos, m->model->layers[il].rope_freqs, il), D, l * k, KV);
        }
        if (t.n_raw[0] > 0) {  // raw keys are stored rotated
            ggml_tensor * raw = ggml_reshape_3d(ctx, raw_rows(t.rk, t.k_rslot, chosen, k), D, l * k, KV);
            zk = zk != nullptr ? ggml_add_inplace(ctx, zk, raw) : raw;
        }
        if (t.n_factored[1] > 0) {
            ggml_tensor * f = ggml_reshape_2d(ctx, ggml_get_rows(ctx, t.v_fslot, chosen), k, KV);
            ggml_tensor * u = ggml_reshape_3d(ctx, ggml_get_rows(ctx, t.uv, f), R, l, k * KV);
            ggml_tensor * w = ggml_reshape_3d(ctx, ggml_get_rows(ctx, t.wv, f), R, D, k * KV);
            zv = ggml_mul_mat(ctx, u, w);  // [l, D, k * KV]
        }
        if (t.n_raw[1] > 0) {  // raw values are stored transposed, [l, D] per span
            ggml_tensor * raw = ggml_reshape_3d(ctx, raw_rows(t.rvt, t.v_rslot, chosen, k), l, D, k * KV);
            zv = zv != nullptr ? ggml_add_inplace(ctx, zv, raw) : raw;
        }
        // Kept in f16 while every query block reads them, as the host tier stores them (the products then round
        // the queries and probabilities to f16, as they do for the exact rows): the compute buffer holds the pool
        // once at half the bytes, beside one f32 rebuild at a time.
        z.zk = ggml_cast(ctx, zk, GGML_TYPE_F16);
        if (T == 1) {  // [l, D, k, KV] -> [l, k, D, KV]: row j * l + r of span j, as the keys and the mask order them
            ggml_tensor * zvt = ggml_cast(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, zv, l, D, k, KV), 0, 2, 1, 3), GGML_TYPE_F16);
            z.zvt = ggml_reshape_3d(ctx, zvt, l * k, D, KV);
        } else {  // a chunk's flash attention reads values as rows: [l, D, k, KV] -> [D, l, k, KV]
            z.zv = ggml_reshape_3d(ctx, ggml_cast(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, zv, l, D, k, KV), 1, 0, 2, 3),
                                                  GGML_TYPE_F16), D, l * k, KV);
        }
        z.zmask = ggml_reshape_3d(ctx, ggml_get_rows(ctx, mem->row_mask, chosen), l * k, 1, KV);
        // a zoomed span is represented by its rows only: its summary row leaves the softmax
        ggml_tensor * summary_out = ggml_view_3d(ctx, mem->neg_inf, 1, k, KV, mem->neg_inf->nb[1], mem->neg_inf->nb[2], 0);
        if (ok != nullptr) {  // a slot whose span did not pass: its rows out, its summary row kept
            constexpr float OUT = -1e30f;  // finite: ok * OUT must not be inf * 0
            ggml_tensor * rows_out = ggml_repeat_4d(ctx, ggml_scale_bias(ctx, ok, -OUT, OUT), l, k, KV, 1);
            z.zmask = ggml_add(ctx, z.zmask, ggml_reshape_3d(ctx, rows_out, l * k, 1, KV));
            summary_out = ggml_add(ctx, ggml_get_rows(ctx, coarse_bias, chosen), ggml_scale(ctx, ok, OUT));
        }
        z.coarse_bias = ggml_reshape_3d(ctx, ggml_set_rows(ctx, coarse_bias, summary_out, chosen), S, 1, KV);
        return z;
    }

    // A decode step's attention: its query rows q scaled [D, g, KV] over the layer's memory and zoom z -> [D, g, KV].
    ggml_tensor * attend_rows(int il, ggml_tensor * q, int64_t g, const zoom_set & z) const {
        const sekv_layer_tensors & t = mem->layers[il];
        const int64_t S = mem->params.n_spans, l = mem->params.span_rows, P = t.n_pin_rows, k = z.k;
        ggml_tensor * ek = ggml_view_3d(ctx, t.ek, D, n_rows, KV, t.ek->nb[1], t.ek->nb[2], 0);
        ggml_tensor * evt = ggml_view_3d(ctx, t.evt, n_rows, D, KV, t.evt->nb[1], t.evt->nb[2], 0);
        ggml_tensor * scores = ggml_mul_mat(ctx, ek, q);  // [n_rows, g, KV]
        if (P > 0) {
            ggml_tensor * pk = ggml_view_3d(ctx, t.pk, D, P, KV, t.pk->nb[1], t.pk->nb[2], 0);
            scores = ggml_concat(ctx, scores, ggml_mul_mat(ctx, pk, q), 0);  // [n_rows + P, g, KV]
        }
        const int64_t n_direct = n_rows + P;  // rows attended as they are: exact, then pinned
        if (S > 0) {
            scores = ggml_concat(ctx, scores, ggml_add(ctx, ggml_mul_mat(ctx, t.sk, q), z.coarse_bias), 0);
        }
        if (k > 0) {
            scores = ggml_concat(ctx, scores, ggml_add(ctx, ggml_mul_mat(ctx, z.zk, q), z.zmask), 0);  // + [l*k, g, KV]
        }
        ggml_tensor * probs = ggml_soft_max(ctx, scores);  // [N, g, KV]
        ggml_tensor * out = ggml_mul_mat(ctx, evt, rows(probs, 0, n_rows));  // [D, g, KV]
        if (P > 0) {
            ggml_tensor * pvt = ggml_view_3d(ctx, t.pvt, P, D, KV, t.pvt->nb[1], t.pvt->nb[2], 0);
            out = ggml_add(ctx, out, ggml_mul_mat(ctx, pvt, rows(probs, n_rows, P)));
        }
        if (S > 0) {
            out = ggml_add(ctx, out, ggml_mul_mat(ctx, t.svt, rows(probs, n_direct, S)));
        }
        if (k > 0) {
            out = ggml_add(ctx, out, ggml_mul_mat(ctx, z.zvt, rows(probs, n_direct + S, l * k)));
        }
        return out;
    }

    // Rows a layer's attention reads per KV head: exact, pinned, summaries and the zoomed spans' rows.
    int64_t attended_rows(int il) const {
        const sekv_layer_tensors & t = mem->layers[il];
        if (t.local) return mem->ring;
        const int64_t S = mem->params.n_spans, l = mem->params.span_rows;
        const int64_t k = std::min<int64_t>(mem->params.zoom_k, std::max<int64_t>(S - t.n_pinned_spans, 0));
        return n_rows + t.n_pin_rows + S + l * k;
    }

    // f32 [n, 1] of one value (ggml makes no constant tensors: a range scaled to 0, plus the value)
    ggml_tensor * filled(int64_t n, float value) const {
        return ggml_scale_bias(ctx, ggml_arange(ctx, 0.0f, (float) n, 1.0f), 0.0f, value);
    }

    // keys [D, n, KV] f16 with each row's bias f32 [n, 1, KV] (nullptr: 0) as one more component -> [D + 1, n, KV]
    // f16: a query whose extra component is 1 then scores q.k + bias, so one flash-attention call needs no per-head
    // mask for the summary biases and the zoomed spans' padding
    ggml_tensor * biased(ggml_tensor * keys, ggml_tensor * bias, int64_t n) const {
        ggml_tensor * b = bias != nullptr ? bias : filled(n * KV, 0.0f);
        return ggml_concat(ctx, keys, ggml_cast(ctx, ggml_reshape_3d(ctx, b, 1, n, KV), GGML_TYPE_F16), 0);
    }

    // values stored transposed [n, D, KV] -> rows [D, n, KV] f16
    ggml_tensor * as_rows(ggml_tensor * vt) const { return ggml_cont(ctx, ggml_transpose(ctx, vt)); }

    // Query tokens per flash-attention call of a chunk: its mask [N, n] f16 (made through an f32 part) stays near
    // SEKV_BLOCK_BYTES, but a call has at least the 64 tokens from which ggml's CPU flash attention runs tiled
    // (GGML_FA_TILE_Q; below it, one query row at a time).
    int64_t flash_block_tokens(int64_t N) const {
        constexpr int64_t unit = 64;
        const int64_t fit = SEKV_BLOCK_BYTES / std::max<int64_t>(N * 4, 1);
        return unit * std::max<int64_t>(1, fit / unit);
    }

    // A chunk's attention (q scaled [D, G, KV], causal f32 [n_rows, 1, T, 1]) as ggml's flash attention over every
    // row it may read, [exact | pinned | summaries | zoomed], with the biases folded into the keys: the scores are
    // never materialised (the blocked products read the chunk's scores several times over and were slower than
    // the torch engine's). -> [D, G, KV]
    ggml_tensor * attend_chunk(int il, ggml_tensor * q, ggml_tensor * causal, const zoom_set & z) const {
        const sekv_layer_tensors & t = mem->layers[il];
        const int64_t S = mem->params.n_spans, l = mem->params.span_rows, P = t.n_pin_rows, k = z.k;
        ggml_tensor * ek = ggml_view_3d(ctx, t.ek, D, n_rows, KV, t.ek->nb[1], t.ek->nb[2], 0);
        ggml_tensor * evt = ggml_view_3d(ctx, t.evt, n_rows, D, KV, t.evt->nb[1], t.evt->nb[2], 0);
        ggml_tensor * keys = biased(ek, nullptr, n_rows);
        ggml_tensor * values = as_rows(evt);
        if (P > 0) {
            keys = ggml_concat(ctx, keys, biased(ggml_view_3d(ctx, t.pk, D, P, KV, t.pk->nb[1], t.pk->nb[2], 0), nullptr, P), 1);
            values = ggml_concat(ctx, values, as_rows(ggml_view_3d(ctx, t.pvt, P, D, KV, t.pvt->nb[1], t.pvt->nb[2], 0)), 1);
        }
        if (S > 0) {
            keys = ggml_concat(ctx, keys, biased(t.sk, z.coarse_bias, S), 1);
            values = ggml_concat(ctx, values, as_rows(t.svt), 1);
        }
        if (k > 0) {
            keys = ggml_concat(ctx, keys, biased(z.zk, z.zmask, l * k), 1);
            values = ggml_concat(ctx, values, z.zv, 1);
        }
        return flash(q, keys, values, causal, true);
    }

    // Flash attention of the query rows q [D, G, KV] over keys, values [D (+ 1 when biased), N, KV], in blocks of
    // tokens that bound the mask: mask f32 [M, 1, T, 1] (0 / -inf) for the first M rows, every later row seen by
    // every token. biased: the keys carry each row's bias as one more component (see biased()). A block's queries
    // go in as llama.cpp lays them out, [D, tokens, heads] (a head reads KV head h / Gh), so that one mask row per
    // token serves all its heads: the mask is Gh times smaller than one per query row, and a block of the same
    // bytes holds Gh times the tokens (64-token blocks ran Gemma 3's chunks at half the speed). -> [D, G, KV]
    ggml_tensor * flash(ggml_tensor * q, ggml_tensor * keys, ggml_tensor * values, ggml_tensor * mask_rows,
                        bool with_bias) const {
        const int64_t Gh = G / T, M = mask_rows->ne[0];
        const int64_t N = keys->ne[1], block = std::min<int64_t>(flash_block_tokens(N), T);
        ggml_tensor * out = nullptr;
        for (int64_t a = 0; a < T; a += block) {
            const int64_t n = std::min(block, T - a);
            ggml_tensor * qx = ggml_view_4d(ctx, q, D, Gh, n, KV, q->nb[1], Gh * q->nb[1], q->nb[2], a * Gh * q->nb[1]);
            qx = ggml_reshape_3d(ctx, ggml_cont(ctx, ggml_permute(ctx, qx, 0, 2, 1, 3)), D, n, Gh * KV);  // [D, n, H]
            if (with_bias) {
                qx = ggml_concat(ctx, qx, ggml_reshape_3d(ctx, filled(n * Gh * KV, 1.0f), 1, n, Gh * KV), 0);
            }
            // [N, n]: the first M rows' mask for each token, 0 for every later row
            ggml_tensor * mb = ggml_view_2d(ctx, mask_rows, M, n, mask_rows->nb[2], a * mask_rows->nb[2]);
            ggml_tensor * mask = ggml_cast(ctx, mb, GGML_TYPE_F16);
            if (N > M) {  // made in f16: it is most of the mask
                ggml_tensor * zero = ggml_cast(ctx, ggml_reshape_2d(ctx, filled(1, 0.0f), 1, 1), GGML_TYPE_F16);
                mask = ggml_concat(ctx, mask, ggml_repeat_4d(ctx, zero, N - M, n, 1, 1), 0);
            }
            ggml_tensor * o = ggml_flash_attn_ext(ctx, qx, keys, values, mask, 1.0f, 0.0f, 0.0f);  // [D, H, n]
            ggml_flash_attn_ext_set_prec(o, GGML_PREC_F32);
            // [D, Gh, KV, n] -> [D, Gh, n, KV] -> [D, Gh n, KV]
            ggml_tensor * part = ggml_reshape_3d(ctx, ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, o, D, Gh, KV, n),
                                                                                  0, 1, 3, 2)), D, Gh * n, KV);
            out = out == nullptr ? part : ggml_concat(ctx, out, part, 1);
        }
        return out;
    }

    // A sliding-window layer: the step's rows k, v [D, T, KV] (k rotated) written to its ring at `slots` i32 [T], then
    // q scaled [D, G, KV] attends to the ring rows `window_mask` f32 [C, 1, T, 1] lets each token see. -> [D, G, KV]
    ggml_tensor * attend_window(int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * slots,
                                ggml_tensor * window_mask) const {
        const sekv_layer_tensors & t = mem->layers[il];
        ggml_tensor * keys = ggml_set_rows(ctx, t.ring_k, k, slots);
        ggml_tensor * values = ggml_set_rows(ctx, t.ring_v, v, slots);
        return flash(q, keys, values, window_mask, false);
    }

    // attention of the query rows q [D, G, KV] (q_pre: the same before RoPE) over the layer's memory -> [D, G, KV];
    // causal f32 [n_rows, 1, T, 1]: 0 or -inf per exact row and token (a chunk's own rows), nullptr for one token.
    // One zoom choice for all rows.
    ggml_tensor * attend(int il, ggml_tensor * q, ggml_tensor * q_pre, ggml_tensor * causal, ggml_tensor ** zoom_out,
                         ggml_tensor ** passed_out) const {
        q = ggml_scale(ctx, q, m->q_scale);  // every score below is a scaled logit
        const zoom_set z = mem->params.n_spans > 0 ? zoom(il, q, q_pre, zoom_out, passed_out) : zoom_set{};
        return T > 1 ? attend_chunk(il, q, causal, z) : attend_rows(il, q, G, z);
    }
};

ggml_tensor * matmul_bias(ggml_context * ctx, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x) {
    ggml_tensor * y = ggml_mul_mat(ctx, w, x);
    return b != nullptr ? ggml_add(ctx, y, b) : y;
}

}  // namespace

// logits -> cap tanh(logits / cap) when cap > 0 (Gemma's final soft cap)
static ggml_tensor * softcapped(ggml_context * ctx, ggml_tensor * logits, float cap) {
    return cap > 0.0f ? ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, logits, 1.0f / cap)), cap) : logits;
}

// Concatenation of parts [1, n] along dim 0 -> [parts, n], as a balanced tree (a chain would copy O(parts^2) rows).
static ggml_tensor * stack_rows(ggml_context * ctx, const std::vector<ggml_tensor *> & parts, size_t from, size_t to) {
    if (to - from == 1) return parts[from];
    const size_t mid = from + (to - from) / 2;
    return ggml_concat(ctx, stack_rows(ctx, parts, from, mid), stack_rows(ctx, parts, mid, to), 0);
}

// log sum exp over dim 0: [n, T] -> [1, T]
static ggml_tensor * log_sum_exp(ggml_context * ctx, ggml_tensor * a) {
    ggml_tensor * top = ggml_pool_1d(ctx, a, GGML_OP_POOL_MAX, (int) a->ne[0], (int) a->ne[0], 0);  // [1, T]
    return ggml_add(ctx, ggml_log(ctx, ggml_sum_rows(ctx, ggml_exp(ctx, ggml_sub(ctx, a, top)))), top);
}

// The chunk's surprisal: -log p(token[i + 1] | up to i) for i < T - 1 from the final hidden rows x [n_embd, T],
// without a [V, T] tensor: each block of sekv_nll_rows vocabulary rows gives every token's log-sum-exp over it, and
// the blocks' combine; the target's logit is its output row times the hidden row. targets i32 [T - 1]: token[i + 1].
// rows i32 [R] (nullptr: the whole vocabulary): the shortlist of vocabulary ids to normalise over, the targets
// among them; its blocks are gathered from the output matrix, so only R of its rows are read.
static ggml_tensor * chunk_nll(ggml_context * ctx, ggml_tensor * output, ggml_tensor * x, ggml_tensor * targets,
                               ggml_tensor * rows, int64_t T, int64_t V, float cap) {
    ggml_tensor * xs = ggml_view_2d(ctx, x, x->ne[0], T - 1, x->nb[1], 0);  // the rows that predict a chunk token
    const int64_t block = sekv_nll_rows(T - 1);
    const int64_t R = rows != nullptr ? rows->ne[0] : V;
    std::vector<ggml_tensor *> parts;
    for (int64_t a = 0; a < R; a += block) {
        const int64_t n = std::min(block, R - a);
        ggml_tensor * w = rows != nullptr
            ? ggml_get_rows(ctx, output, ggml_view_1d(ctx, rows, n, a * rows->nb[0]))  // [n_embd, n] f32
            : ggml_view_2d(ctx, output, output->ne[0], n, output->nb[1], a * output->nb[1]);
        parts.push_back(log_sum_exp(ctx, softcapped(ctx, ggml_mul_mat(ctx, w, xs), cap)));  // [1, T - 1]
    }
    ggml_tensor * lse = log_sum_exp(ctx, stack_rows(ctx, parts, 0, parts.size()));
    ggml_tensor * target = ggml_sum_rows(ctx, ggml_mul(ctx, ggml_get_rows(ctx, output, targets), xs));  // [1, T - 1]
    return ggml_sub(ctx, lse, softcapped(ctx, target, cap));
}

size_t sekv_graph_nodes(const sekv_memory * mem, int64_t T, int64_t score_rows) {
    const sekv_model_info & info = mem->model->info;
    const int64_t H = info.n_head, KV = info.n_head_kv;
    step_builder b{const_cast<sekv_memory *>(mem), nullptr, mem->model, info.head_dim, H, KV, T * (H / KV),
                   mem->n_exact + T, T};
    const int64_t scored = score_rows > 0 ? score_rows : info.n_vocab;
    const int64_t nll_blocks = (scored + sekv_nll_rows(T - 1) - 1) / sekv_nll_rows(T - 1);
    size_t nodes = 256 + 16 * (size_t) nll_blocks;
    for (int il = 0; il < info.n_layer; ++il) {
        const int64_t block = T > 1 ? b.flash_block_tokens(b.attended_rows(il)) : 1;
        const int64_t mlp_block = std::max<int64_t>(1, SEKV_MLP_BLOCK_BYTES / (4 * mem->model->model->layers[il].ffn_up->ne[1]));
        // a layer's own ops, each attention block's and each MLP block's
        nodes += 96 + 64 * (size_t) ((T + block - 1) / block) + 16 * (size_t) ((T + mlp_block - 1) / mlp_block);
    }
    return nodes;
}

ggml_cgraph * sekv_build_graph(sekv_memory * mem, ggml_context * ctx, int64_t T, bool with_nll, int64_t score_rows,
                               sekv_graph_inputs & in, sekv_zoom_outputs & zoom) {
    const sekv_model * m = mem->model;
    const llama_model & lm = *m->model;
    const sekv_model_info & info = m->info;
    const int64_t D = info.head_dim, H = info.n_head, KV = info.n_head_kv, Gh = H / KV;
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, sekv_graph_nodes(mem, T, score_rows), false);

    in.tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    in.pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
    ggml_set_input(in.tokens);
    ggml_set_input(in.pos);
    const int64_t n_rows = mem->n_exact + T;
    in.causal = nullptr;
    if (T > 1) {
        in.causal = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, n_rows, 1, T, 1);
        ggml_set_input(in.causal);
    }
    step_builder b{mem, ctx, m, D, H, KV, T * Gh, n_rows, T};

    // [D, H, T] (head h = kv * Gh + g) -> query rows [D, Gh * T, KV], query head fastest
    auto query_rows = [&](ggml_tensor * x) {
        ggml_tensor * r = ggml_permute(ctx, ggml_reshape_4d(ctx, x, D, Gh, KV, T), 0, 1, 3, 2);  // [D, Gh, T, KV]
        return ggml_reshape_3d(ctx, ggml_cont(ctx, r), D, Gh * T, KV);
    };

    if (mem->ring > 0) {
        in.ring_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T);
        in.window_mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, mem->ring, 1, T, 1);
        ggml_set_input(in.ring_slots);
        ggml_set_input(in.window_mask);
    }
    auto norm = [&](ggml_tensor * a, ggml_tensor * weight) { return ggml_mul(ctx, ggml_rms_norm(ctx, a, m->norm_eps), weight); };
    // the routing queries are the torch engine's: normed, pre-RoPE, times the model's scale over 1/sqrt(D)
    const float q_pre_scale = m->q_scale * std::sqrt((float) D);

    ggml_tensor * x = ggml_get_rows(ctx, lm.tok_embd, in.tokens);  // [n_embd, T]
    if (m->embed_scale != 1.0f) x = ggml_scale(ctx, x, m->embed_scale);
    zoom.chosen.assign(info.n_layer, nullptr);
    zoom.passed.assign(info.n_layer, nullptr);
    for (int il = 0; il < info.n_layer; ++il) {
        const llama_layer & w = lm.layers[il];
        ggml_tensor * cur = norm(x, w.attn_norm);
        ggml_tensor * q, * k, * v;
        if (w.wqkv != nullptr) {
            ggml_tensor * qkv = matmul_bias(ctx, w.wqkv, w.wqkv_b, cur);
            q = ggml_cont(ctx, ggml_view_2d(ctx, qkv, D * H, T, qkv->nb[1], 0));
            k = ggml_cont(ctx, ggml_view_2d(ctx, qkv, D * KV, T, qkv->nb[1], D * H * qkv->nb[0]));
            v = ggml_cont(ctx, ggml_view_2d(ctx, qkv, D * KV, T, qkv->nb[1], D * (H + KV) * qkv->nb[0]));
        } else {
            q = matmul_bias(ctx, w.wq, w.wq_b, cur);
            k = matmul_bias(ctx, w.wk, w.wk_b, cur);
            v = matmul_bias(ctx, w.wv, w.wv_b, cur);
        }
        q = ggml_reshape_3d(ctx, q, D, H, T);
        k = ggml_reshape_3d(ctx, k, D, KV, T);
        if (w.attn_q_norm != nullptr) {  // per-head RMSNorm before RoPE (Gemma 3)
            q = norm(q, w.attn_q_norm);
            k = norm(k, w.attn_k_norm);
        }
        ggml_tensor * q_normed = q;
        q = b.rope(q, in.pos, w.rope_freqs, il);
        k = b.rope(k, in.pos, w.rope_freqs, il);
        ggml_tensor * k_rows = ggml_permute(ctx, k, 0, 2, 1, 3);                         // [D, T, KV]
        ggml_tensor * v_rows = ggml_permute(ctx, ggml_reshape_3d(ctx, v, D, KV, T), 0, 2, 1, 3);  // [D, T, KV]

        const sekv_layer_tensors & t = mem->layers[il];
        ggml_tensor * attn;
        if (t.local) {
            attn = b.attend_window(il, ggml_scale(ctx, query_rows(q), m->q_scale), k_rows, v_rows, in.ring_slots,
                                   in.window_mask);
        } else {
            ggml_tensor * q_pre = query_rows(q_pre_scale != 1.0f ? ggml_scale(ctx, q_normed, q_pre_scale) : q_normed);
            // the new tokens become exact rows [n_exact, n_exact + T) of this layer
            const int64_t row = mem->n_exact;
            ggml_tensor * k_dst = ggml_view_3d(ctx, t.ek, D, T, KV, t.ek->nb[1], t.ek->nb[2], row * t.ek->nb[1]);
            ggml_tensor * v_dst = ggml_view_3d(ctx, t.evt, T, D, KV, t.evt->nb[1], t.evt->nb[2], row * t.evt->nb[0]);
            ggml_build_forward_expand(gf, ggml_cpy(ctx, k_rows, k_dst));
            ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, v, D, KV, T), 1, 2, 0, 3),
                                                   v_dst));  // [T, D, KV]
            attn = b.attend(il, query_rows(q), q_pre, in.causal, &zoom.chosen[il], &zoom.passed[il]);
        }
        // [D, Gh * T, KV] -> [D, Gh, KV, T] = [D * H, T]
        attn = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_4d(ctx, attn, D, Gh, T, KV), 0, 1, 3, 2));
        ggml_tensor * attn_out = matmul_bias(ctx, w.wo, w.wo_b, ggml_reshape_2d(ctx, attn, D * H, T));
        if (w.attn_post_norm != nullptr) attn_out = norm(attn_out, w.attn_post_norm);
        x = ggml_add(ctx, x, attn_out);

        // the MLP over blocks of tokens: a chunk's [n_ff, T] activations were most of its compute buffer
        cur = norm(x, w.ffn_norm);
        const int64_t n_ff = w.ffn_up->ne[1], block = std::max<int64_t>(1, SEKV_MLP_BLOCK_BYTES / (4 * n_ff));
        ggml_tensor * ffn_out = nullptr;
        for (int64_t a = 0; a < T; a += block) {
            ggml_tensor * h = ggml_view_2d(ctx, cur, cur->ne[0], std::min(block, T - a), cur->nb[1], a * cur->nb[1]);
            ggml_tensor * gate = matmul_bias(ctx, w.ffn_gate, w.ffn_gate_b, h);
            gate = m->gelu ? ggml_gelu(ctx, gate) : ggml_silu(ctx, gate);
            ggml_tensor * up = matmul_bias(ctx, w.ffn_up, w.ffn_up_b, h);
            ggml_tensor * part = matmul_bias(ctx, w.ffn_down, w.ffn_down_b, ggml_mul(ctx, gate, up));
            ffn_out = ffn_out == nullptr ? part : ggml_concat(ctx, ffn_out, part, 1);
        }
        if (w.ffn_post_norm != nullptr) ffn_out = norm(ffn_out, w.ffn_post_norm);
        x = ggml_add(ctx, x, ffn_out);
    }
    x = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->norm_eps), lm.output_norm);
    ggml_tensor * last = ggml_view_2d(ctx, x, x->ne[0], 1, x->nb[1], (T - 1) * x->nb[1]);
    ggml_tensor * logits = softcapped(ctx, ggml_mul_mat(ctx, lm.output, last), m->logit_softcap);
    ggml_set_output(logits);
    ggml_set_name(logits, "logits");
    ggml_build_forward_expand(gf, logits);
    in.nll_index = nullptr;
    in.score_rows = nullptr;
    if (with_nll && T > 1) {
        in.nll_index = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, T - 1);
        ggml_set_input(in.nll_index);
        if (score_rows > 0) {
            in.score_rows = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, score_rows);
            ggml_set_input(in.score_rows);
        }
        ggml_tensor * nll = chunk_nll(ctx, lm.output, x, in.nll_index, in.score_rows, T, info.n_vocab,
                                      m->logit_softcap);
        ggml_set_output(nll);
        ggml_set_name(nll, "nll");
        ggml_build_forward_expand(gf, nll);
    }
    for (const auto * outputs : {&zoom.chosen, &zoom.passed}) {
        for (ggml_tensor * z : *outputs) {
            if (z != nullptr) ggml_build_forward_expand(gf, z);
        }
    }
    return gf;
}
