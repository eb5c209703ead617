/* Built against an installed decodev2 (pkg-config flags), as C and as C++: the header must
 * compile cleanly in both, and the program must find the library without LD_LIBRARY_PATH.
 * Prints the version and the first greedy id of the tiny_llama preset. */
#include <decodev2.h>
#include <stdio.h>

int main(void) {
    dv2_options opts = dv2_options_default();
    opts.backend = DV2_BACKEND_CPU;
    dv2_engine *e = NULL;
    dv2_status s = dv2_load_synthetic("tiny_llama", 0, &opts, &e);
    if (s != DV2_OK) {
        fprintf(stderr, "%s: %s\n", dv2_status_name(s), dv2_last_error());
        return 1;
    }
    int32_t prompt[] = {1, 2, 3};
    int32_t next = -1;
    s = dv2_prefill(e, prompt, 3, &next);
    dv2_free(e);
    if (s != DV2_OK) return 1;
    printf("decodev2 %s: next id %d\n", dv2_version(), (int)next);
    return 0;
}
