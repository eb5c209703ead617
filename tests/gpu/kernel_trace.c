// A CUPTI activity tracer to LD_PRELOAD into a CUDA program (tests/gpu/trace-graph.sh builds
// and runs it): every kernel's start and end on the GPU, graph nodes included, written at exit
// as CSV to $DV2_TRACE_OUT (default kernel-trace.csv). Why: ncu times kernels one at a time,
// and the GPU machine has no Nsight Systems; inside the decode graph kernels overlap (PDL), and
// what a step's time is made of is the sequence of starts and ends.
#define _POSIX_C_SOURCE 200809L  // strdup
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUFFER_BYTES (8u << 20)

struct record {
    unsigned long long start, end;
    const char* name;
    int grid, block, regs, smem;
    unsigned graph;
};

static struct record* records;
static size_t n_records, cap_records;

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = aligned_alloc(8, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static void keep(const CUpti_ActivityKernel10* k) {
    if (n_records == cap_records) {
        size_t cap = cap_records ? 2 * cap_records : 1 << 16;
        struct record* grown = realloc(records, cap * sizeof *records);
        if (!grown) return;
        records = grown, cap_records = cap;
    }
    records[n_records++] = (struct record){k->start, k->end, strdup(k->name ? k->name : "?"),
                                           k->gridX * k->gridY * k->gridZ, k->blockX * k->blockY * k->blockZ,
                                           k->registersPerThread, k->staticSharedMemory + k->dynamicSharedMemory,
                                           k->graphId};
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity* r = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS)
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) keep((const CUpti_ActivityKernel10*)r);
    free(buffer);
}

__attribute__((constructor)) static void start_trace(void) {
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS)
        fprintf(stderr, "kernel_trace: CUPTI activity tracing could not start\n");
    // Completed buffers also delivered every 100 ms, so that the records are in hand even if
    // the final flush at exit comes after CUPTI's own teardown.
    cuptiActivityFlushPeriod(100);
}

__attribute__((destructor)) static void write_trace(void) {
    cuptiActivityFlushAll(1);
    // A process that launched no kernel (a wrapper the preload reached too) leaves the file alone.
    if (!n_records) return;
    const char* path = getenv("DV2_TRACE_OUT");
    FILE* f = fopen(path ? path : "kernel-trace.csv", "w");
    if (!f) return;
    fprintf(f, "start_ns,end_ns,name,grid,block,regs,smem,graph\n");
    for (size_t i = 0; i < n_records; i++) {
        const struct record* r = &records[i];
        fprintf(f, "%llu,%llu,%s,%d,%d,%d,%d,%u\n", r->start, r->end, r->name, r->grid, r->block, r->regs, r->smem,
                r->graph);
    }
    fclose(f);
    fprintf(stderr, "kernel_trace: %zu kernels written\n", n_records);
}
