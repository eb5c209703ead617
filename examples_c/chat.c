/* decodev2 C example: text in, streamed text out. One user message through the model file's
 * own chat template and tokenizer, then greedy decoding printed piece by piece until the
 * model's end of generation (dv2_options.eos_id = -2: the file's end-of-turn or EOS id).
 *
 *   chat MODEL "What is the capital of France?" [--backend auto|cpu|cuda] [--tokens N]
 *        [--prompt-cache FILE]
 *
 * A piece can end inside a UTF-8 character (an emoji spans several ids), so the bytes are
 * gathered and printed up to the last complete character. With --prompt-cache, the request is
 * saved to FILE at the end (dv2_state_save_file), and a later run loads it first
 * (dv2_state_load_file) and prefills only the ids its prompt does not share with the saved
 * ones (dv2_rewind to where they part). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decodev2.h"

static int fail(const char *call, dv2_status s) {
    fprintf(stderr, "%s: %s: %s\n", call, dv2_status_name(s), dv2_last_error());
    return 1;
}

/* Bytes of text[0 .. n) that end on a whole UTF-8 character (a cut sequence at the end is
 * held back; at most 3 bytes). */
static size_t complete_utf8(const unsigned char *text, size_t n) {
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = text[n - back];
        if ((c & 0xC0) == 0x80) continue; /* a continuation byte: look further back */
        size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return len > back ? n - back : n;
    }
    return n;
}

int main(int argc, char **argv) {
    const char *model = NULL, *question = NULL, *backend = "auto", *cache = NULL;
    int max_tokens = 64;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) max_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prompt-cache") && i + 1 < argc) cache = argv[++i];
        else if (!model) model = argv[i];
        else if (!question) question = argv[i];
    }
    if (!model || !question || max_tokens < 1) {
        fprintf(stderr, "usage: chat MODEL QUESTION [--backend auto|cpu|cuda] [--tokens N] [--prompt-cache FILE]\n");
        return 2;
    }
    dv2_options opts = dv2_options_default();
    opts.backend = !strcmp(backend, "cpu") ? DV2_BACKEND_CPU : !strcmp(backend, "cuda") ? DV2_BACKEND_CUDA : DV2_BACKEND_AUTO;
    opts.eos_id = -2;
    dv2_engine *e = NULL;
    dv2_status s = dv2_load(model, &opts, &e);
    if (s != DV2_OK) return fail("dv2_load", s);

    /* The conversation as the model expects it; its markers parsed as special ids. */
    dv2_chat_message msg = {"user", question};
    size_t len = 0;
    s = dv2_chat_apply_template(e, &msg, 1, 1, NULL, 0, &len);
    if (s != DV2_OK && s != DV2_ERR_BUFFER_TOO_SMALL) return fail("dv2_chat_apply_template", s);
    char *prompt = malloc(len + 1);
    int32_t *ids = NULL, *saved = NULL;
    enum { PENDING = 4096 }; /* room for a piece and a held partial character */
    unsigned char *pending = malloc(PENDING);
    int rc = 1;
    if (!prompt || !pending) goto done;
    if ((s = dv2_chat_apply_template(e, &msg, 1, 1, prompt, len, &len)) != DV2_OK) {
        rc = fail("dv2_chat_apply_template", s);
        goto done;
    }
    size_t n_ids = 0;
    s = dv2_tokenize(e, prompt, len, DV2_TOKENIZE_ADD_SPECIAL | DV2_TOKENIZE_PARSE_SPECIAL, NULL, 0, &n_ids);
    if (s != DV2_OK && s != DV2_ERR_BUFFER_TOO_SMALL) {
        rc = fail("dv2_tokenize", s);
        goto done;
    }
    ids = malloc((n_ids ? n_ids : 1) * sizeof *ids);
    if (!ids) goto done;
    if ((s = dv2_tokenize(e, prompt, len, DV2_TOKENIZE_ADD_SPECIAL | DV2_TOKENIZE_PARSE_SPECIAL, ids, n_ids, &n_ids)) != DV2_OK) {
        rc = fail("dv2_tokenize", s);
        goto done;
    }

    /* The ids a saved request holds: those the prompt begins with need no prefill (at least
     * its last id is prefilled, for the id after it). */
    size_t keep = 0;
    if (cache) {
        dv2_model_info info = {.struct_size = sizeof info};
        size_t n_saved = 0;
        if ((s = dv2_get_model_info(e, &info)) != DV2_OK) {
            rc = fail("dv2_get_model_info", s);
            goto done;
        }
        saved = malloc((size_t)info.max_seq * sizeof *saved); /* a state holds at most max_seq */
        if (!saved) goto done;
        s = dv2_state_load_file(e, cache, saved, (size_t)info.max_seq, &n_saved);
        if (s == DV2_OK) {
            while (keep < n_saved && keep + 1 < n_ids && saved[keep] == ids[keep]) keep++;
            if ((s = dv2_rewind(e, (int32_t)keep)) != DV2_OK) {
                rc = fail("dv2_rewind", s);
                goto done;
            }
        } else if (s != DV2_ERR_IO) { /* no file yet is the first run; others are worth a word */
            fprintf(stderr, "prompt cache not used: %s: %s\n", dv2_status_name(s), dv2_last_error());
        }
    }
    int32_t id;
    if ((s = dv2_prefill(e, ids + keep, n_ids - keep, &id)) != DV2_OK) {
        rc = fail("dv2_prefill", s);
        goto done;
    }
    size_t held = 0;
    int ended = 0;
    for (int t = 0; t < max_tokens; t++) {
        int32_t finished = 0;
        if ((s = dv2_finished(e, &finished)) != DV2_OK) {
            rc = fail("dv2_finished", s);
            goto done;
        }
        if (finished) { /* id is the end of generation: not printed */
            ended = 1;
            break;
        }
        size_t n = 0;
        if ((s = dv2_token_to_piece(e, id, (char *)pending + held, PENDING - held, &n)) != DV2_OK) {
            rc = fail("dv2_token_to_piece", s);
            goto done;
        }
        held += n;
        size_t ready = complete_utf8(pending, held);
        fwrite(pending, 1, ready, stdout);
        fflush(stdout);
        memmove(pending, pending + ready, held - ready);
        held -= ready;
        if (t + 1 == max_tokens) break;
        if ((s = dv2_step(e, &id)) != DV2_OK) {
            rc = fail("dv2_step", s);
            goto done;
        }
    }
    fwrite(pending, 1, held, stdout);
    printf("\n");
    fprintf(stderr, ended ? "[end of generation]\n" : "[token limit]\n");
    if (cache) {
        if ((s = dv2_state_save_file(e, cache)) != DV2_OK) {
            rc = fail("dv2_state_save_file", s);
            goto done;
        }
        fprintf(stderr, "[prompt cache: %zu of %zu prompt ids reused]\n", keep, n_ids);
    }
    rc = 0;
done:
    free(prompt);
    free(ids);
    free(saved);
    free(pending);
    dv2_free(e);
    return rc;
}
