/* decodev2 C example: runs the oracle gates of tests/fixtures/oracle_gates.txt through the
 * C ABI and exits non-zero on any mismatch.
 *
 *   gates [--backend auto|cpu|cuda] [--fixture PATH] [--quiet]
 *
 * For each case: load the synthetic preset, prefill prompt[..prefill_len], take next_token,
 * then dv2_step_n for the remaining greedy ids; then reset and teacher-force the prompt one
 * id at a time, checking that the argmax of dv2_logits equals the fixture's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decodev2.h"

#define MAX_IDS 64

typedef struct {
    char preset[64];
    unsigned long long seed;
    int32_t prompt[MAX_IDS], greedy[MAX_IDS], teacher[MAX_IDS];
    int n_prompt, n_greedy, n_teacher, prefill_len;
} gate_case;

static int read_ids(char *rest, int32_t *out) {
    int n = 0;
    for (char *tok = strtok(rest, " \t\r\n"); tok && n < MAX_IDS; tok = strtok(NULL, " \t\r\n"))
        out[n++] = (int32_t)strtol(tok, NULL, 10);
    return n;
}

/* Reads the next case; returns 1 on a case, 0 at end of file. */
static int next_case(FILE *f, gate_case *c) {
    char line[4096];
    int in_case = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[0] == '\n') continue;
        char *rest = strchr(line, ' ');
        if (rest) *rest++ = '\0';
        else line[strcspn(line, "\r\n")] = '\0';
        if (!strcmp(line, "case")) {
            memset(c, 0, sizeof *c);
            if (sscanf(rest, "%63s %llu", c->preset, &c->seed) != 2) return -1;
            in_case = 1;
        } else if (!in_case) {
            return -1;
        } else if (!strcmp(line, "prompt")) {
            c->n_prompt = read_ids(rest, c->prompt);
        } else if (!strcmp(line, "prefill_len")) {
            c->prefill_len = atoi(rest);
        } else if (!strcmp(line, "greedy")) {
            c->n_greedy = read_ids(rest, c->greedy);
        } else if (!strcmp(line, "teacher")) {
            c->n_teacher = read_ids(rest, c->teacher);
        } else if (!strcmp(line, "end")) {
            return 1;
        }
    }
    return in_case ? -1 : 0;
}

static int check(dv2_status s, const char *what) {
    if (s == DV2_OK) return 1;
    fprintf(stderr, "%s: %s: %s\n", what, dv2_status_name(s), dv2_last_error());
    return 0;
}

static void print_ids(const char *label, const int32_t *ids, int n) {
    printf("  %-8s", label);
    for (int i = 0; i < n; i++) printf(" %d", ids[i]);
    printf("\n");
}

static int same(const int32_t *a, const int32_t *b, int n) {
    return memcmp(a, b, (size_t)n * sizeof *a) == 0;
}

static void on_log(int32_t level, const char *message, void *user_data) {
    if (!*(int *)user_data && level > DV2_LOG_WARN) return;
    fprintf(stderr, "[decodev2 %d] %s\n", level, message);
}

/* Runs one case; returns the number of failed gates (or 1 if the engine failed). */
static int run_case(const gate_case *c, int backend) {
    dv2_options opts = dv2_options_default();
    opts.backend = backend;
    dv2_engine *e = NULL;
    if (!check(dv2_load_synthetic(c->preset, c->seed, &opts, &e), "dv2_load_synthetic")) return 1;
    dv2_model_info info = {0};
    info.struct_size = sizeof info;
    int failures = 0;
    float *logits = NULL;
    if (!check(dv2_get_model_info(e, &info), "dv2_get_model_info")) { failures = 1; goto done; }
    printf("%s seed %llu: backend %s, %d layers, hidden %d, vocab %d, max_seq %d\n", c->preset, c->seed,
           info.backend == DV2_BACKEND_CUDA ? "cuda" : "cpu", info.n_layers, info.hidden, info.vocab,
           info.max_seq);

    int32_t got[MAX_IDS];
    size_t count = 0;
    if (!check(dv2_prefill(e, c->prompt, (size_t)c->prefill_len, &got[0]), "dv2_prefill") ||
        !check(dv2_step_n(e, (size_t)(c->n_greedy - 1), &got[1], &count), "dv2_step_n")) {
        failures = 1;
        goto done;
    }
    print_ids("greedy", got, 1 + (int)count);
    if ((int)count != c->n_greedy - 1 || !same(got, c->greedy, c->n_greedy)) {
        print_ids("expected", c->greedy, c->n_greedy);
        failures++;
    }

    logits = malloc((size_t)info.vocab * sizeof *logits);
    if (!logits || !check(dv2_reset(e), "dv2_reset")) { failures++; goto done; }
    for (int i = 0; i < c->n_prompt; i++) {
        if (!check(dv2_prefill(e, &c->prompt[i], 1, NULL), "dv2_prefill") ||
            !check(dv2_logits(e, logits, (size_t)info.vocab), "dv2_logits")) {
            failures++;
            goto done;
        }
        int best = 0;
        for (int v = 1; v < info.vocab; v++)
            if (logits[v] > logits[best]) best = v;
        got[i] = best;
    }
    print_ids("teacher", got, c->n_prompt);
    if (c->n_teacher != c->n_prompt || !same(got, c->teacher, c->n_teacher)) {
        print_ids("expected", c->teacher, c->n_teacher);
        failures++;
    }
done:
    free(logits);
    dv2_free(e);
    return failures;
}

int main(int argc, char **argv) {
    const char *fixture = "tests/fixtures/oracle_gates.txt";
    int backend = DV2_BACKEND_AUTO, verbose = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
            const char *b = argv[++i];
            if (!strcmp(b, "auto")) backend = DV2_BACKEND_AUTO;
            else if (!strcmp(b, "cpu")) backend = DV2_BACKEND_CPU;
            else if (!strcmp(b, "cuda")) backend = DV2_BACKEND_CUDA;
            else { fprintf(stderr, "unknown backend %s\n", b); return 2; }
        } else if (!strcmp(argv[i], "--fixture") && i + 1 < argc) {
            fixture = argv[++i];
        } else if (!strcmp(argv[i], "--quiet")) {
            verbose = 0;
        } else {
            fprintf(stderr, "usage: %s [--backend auto|cpu|cuda] [--fixture PATH] [--quiet]\n", argv[0]);
            return 2;
        }
    }
    dv2_set_log_callback(on_log, &verbose);
    printf("decodev2 %s, fixture %s\n", dv2_version(), fixture);
    FILE *f = fopen(fixture, "r");
    if (!f) { perror(fixture); return 2; }
    gate_case c;
    int status, cases = 0, failures = 0;
    while ((status = next_case(f, &c)) == 1) {
        cases++;
        failures += run_case(&c, backend);
    }
    fclose(f);
    dv2_set_log_callback(NULL, NULL);
    if (status < 0 || cases == 0) { fprintf(stderr, "%s: malformed fixture\n", fixture); return 2; }
    printf("%d cases, %d failed gates\n", cases, failures);
    return failures ? 1 : 0;
}
