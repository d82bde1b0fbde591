// Stock llama.cpp's own decode on the same loaded model, timed: the baseline the SeKV decode is compared
// with (full f16 KV cache, llama.cpp's unmodified context and graph).
#include "sekv_internal.h"

#include <algorithm>
#include <chrono>
#include <vector>

int sekv_stock_bench(sekv_model * model, int32_t n_context, int32_t n_decode, int32_t flash_attn,
                     double * prefill_tps, double * decode_tps) {
    if (n_context < 1 || n_decode < 1 || flash_attn < -1 || flash_attn > 1) {
        sekv_set_error("sekv_stock_bench: need n_context >= 1, n_decode >= 1, flash_attn in {-1, 0, 1}");
        return -1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (n_context + n_decode + 16);
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = model->n_threads;
    cp.flash_attn_type = flash_attn < 0 ? LLAMA_FLASH_ATTN_TYPE_AUTO
                                        : (flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED);
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model->model, cp);
    if (ctx == nullptr) {
        sekv_set_error("llama.cpp could not create a context of that size");
        return -1;
    }
    // ordinary (non-special) token ids from a fixed LCG: the content does not change the cost
    const int32_t n_vocab = model->info.n_vocab, first = n_vocab > 2000 ? 1000 : 0;
    uint32_t state = 12345u;
    auto next_token = [&] {
        state = state * 1664525u + 1013904223u;
        return first + (int32_t) (state % (uint32_t) (n_vocab - first));
    };
    std::vector<llama_token> prompt(n_context);
    for (auto & t : prompt) t = next_token();

    using clock = std::chrono::steady_clock;
    int status = 0;
    auto start = clock::now();
    for (int32_t at = 0; at < n_context && status == 0; at += (int32_t) cp.n_batch) {
        const int32_t n = std::min<int32_t>((int32_t) cp.n_batch, n_context - at);
        status = llama_decode(ctx, llama_batch_get_one(prompt.data() + at, n));
    }
    llama_synchronize(ctx);
    const double prefill_s = std::chrono::duration<double>(clock::now() - start).count();
    start = clock::now();
    for (int32_t i = 0; i < n_decode && status == 0; ++i) {
        llama_token t = next_token();
        status = llama_decode(ctx, llama_batch_get_one(&t, 1));
        llama_synchronize(ctx);
    }
    const double decode_s = std::chrono::duration<double>(clock::now() - start).count();
    llama_free(ctx);
    if (status != 0) {
        sekv_set_error("llama_decode failed in the stock benchmark");
        return -1;
    }
    *prefill_tps = n_context / prefill_s;
    *decode_tps = n_decode / decode_s;
    return 0;
}
