/* ddtree.c: a whole DDTree decode against kdtree.h, checked against plain greedy decoding.
 *
 *   cc -std=c11 -Icore scripts/examples/ddtree.c -Lbuild -lkdtree -Wl,-rpath,$PWD/build -o ddtree
 *   ./ddtree models/tiny-k2.6 models/tiny-k2.6-dflash [cpu|cuda]   (`make test` and, on cuda,
 *                                                               `make test-gpu` build and run it)
 *   or, installed: cc ddtree.c $(pkg-config --cflags --libs kdtree)
 *
 * Prints the generated ids, the accepted length (tau) of every round, and whether the
 * output equals autoregressive greedy decoding token for token (exit 0 when it does). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kdtree.h"

enum { N_NEW = 32, BUDGET = 16, MAX_TREE = BUDGET + 1 };

/* print the failing call and the engine's message, then leave */
static void check(kd_status st, const char *what)
{
    if (st == KD_OK) return;
    fprintf(stderr, "ddtree: %s failed (%s): %s\n", what, kd_status_name(st), kd_last_error());
    exit(1);
}

/* autoregressive greedy decoding: the reference DDTree must equal */
static void greedy(kd_model *m, const int32_t *prompt, int n_prompt, int32_t *out)
{
    kd_seq *s;
    int32_t ids[16];
    check(kd_seq_new(m, n_prompt + N_NEW + 1, &s), "kd_seq_new");
    check(kd_forward(s, prompt, n_prompt, NULL, NULL), "kd_forward (prefill)");
    check(kd_seq_argmax(s, ids), "kd_seq_argmax");
    out[0] = ids[n_prompt - 1];
    for (int i = 1; i < N_NEW; i++) {
        check(kd_forward(s, &out[i - 1], 1, NULL, NULL), "kd_forward");
        check(kd_seq_argmax(s, ids), "kd_seq_argmax");
        out[i] = ids[0];
    }
    kd_seq_free(s);
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4 || (argc == 4 && strcmp(argv[3], "cpu") != 0 && strcmp(argv[3], "cuda") != 0)) {
        fprintf(stderr, "usage: %s MODEL_DIR DRAFTER_DIR [cpu|cuda]\n", argv[0]);
        return 2;
    }
    const int cuda = argc == 4 && strcmp(argv[3], "cuda") == 0;
    const int32_t prompt[] = { 5, 77, 300 };
    const int n_prompt = 3;

    kd_model_options mo = { .backend = cuda ? KD_BACKEND_CUDA : KD_BACKEND_CPU };   /* zero fields: defaults */
    kd_model *m;
    kd_drafter *d;
    check(kd_model_open(argv[1], &mo, &m), "kd_model_open");
    check(kd_drafter_open(argv[2], m, &d), "kd_drafter_open");
    kd_drafter_info di;
    check(kd_drafter_get_info(d, &di), "kd_drafter_get_info");

    /* room for the prompt, the output, one tree of pending nodes and the drafter's block */
    kd_seq *s;
    kd_tree *t;
    check(kd_seq_new(m, n_prompt + N_NEW + MAX_TREE + di.block_size, &s), "kd_seq_new");
    check(kd_tree_new(&t), "kd_tree_new");
    check(kd_seq_attach_drafter(s, d), "kd_seq_attach_drafter");   /* before the prefill */

    int32_t first[3], out[N_NEW + MAX_TREE];
    check(kd_forward(s, prompt, n_prompt, NULL, NULL), "kd_forward (prefill)");
    check(kd_seq_argmax(s, first), "kd_seq_argmax");
    int32_t bonus = first[n_prompt - 1];
    int n_out = 0;
    out[n_out++] = bonus;

    printf("tau per round:");
    while (n_out < N_NEW) {
        int32_t nodes[MAX_TREE], toks[MAX_TREE];
        int tau;
        check(kd_draft(s, bonus, NULL), "kd_draft");                /* log-probs stay on the backend */
        check(kd_tree_build_drafted(t, s, BUDGET), "kd_tree_build_drafted");
        check(kd_verify(s, t), "kd_verify");
        check(kd_accept(s, t, NULL, nodes, toks, &tau, &bonus), "kd_accept");   /* greedy */
        check(kd_commit(s, t), "kd_commit");
        for (int i = 1; i < tau; i++) out[n_out++] = toks[i];        /* toks[0] is the old bonus */
        out[n_out++] = bonus;
        printf(" %d", tau);
    }
    printf("\noutput:");
    for (int i = 0; i < N_NEW; i++) printf(" %d", out[i]);
    printf("\n");

    int32_t ref[N_NEW];
    greedy(m, prompt, n_prompt, ref);
    int same = memcmp(out, ref, sizeof ref) == 0;
    printf("equals greedy autoregressive decoding: %s\n", same ? "yes" : "NO");

    kd_tree_free(t);
    kd_seq_free(s);
    kd_drafter_close(d);
    kd_model_close(m);
    return same ? 0 : 1;
}
