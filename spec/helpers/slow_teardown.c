// slow_teardown.c: preloaded into the REPL by repl_spec, this gives a CPU process the exit that
// CUDA gives it: a teardown that takes a second, during which a thread that does not block
// SIGINT exists (the library's destructor starts one). A Ctrl-C typed in that window ends the
// process with SIGINT's status unless SIGINT is ignored by then.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

static void *wait_unblocked(void *unused) {
  (void)unused;
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, NULL);
  for (;;) pause();
  return NULL;
}

__attribute__((destructor)) static void slow_teardown(void) {
  pthread_t thread;
  if (pthread_create(&thread, NULL, wait_unblocked, NULL) == 0) pthread_detach(thread);
  sleep(1);
}
