-- interrupt.lua: Ctrl-C (SIGINT) as a flag that the CLI and the REPL poll between rounds.
--
-- LuaJIT cannot run Lua in a signal handler (a callback entered from a signal is unsafe), so
-- no handler is installed: block() blocks SIGINT, which then stays pending, and take() asks
-- the kernel whether one is pending and consumes it (sigtimedwait with a zero timeout). Threads
-- inherit the mask of the thread that starts them, so block() comes first, before the engine
-- starts any (the CUDA runtime does, when a model opens): no thread is left for SIGINT to
-- kill the process through. All of it is libc through the FFI.
local ffi = require("ffi")

-- glibc's sigset_t is 1024 bits; the names are our own so they cannot clash with other cdefs
pcall(ffi.cdef, [[
typedef struct { uint64_t bits[16]; } kd_lua_sigset;
typedef struct { long tv_sec; long tv_nsec; } kd_lua_timespec;
int sigemptyset(kd_lua_sigset *set);
int sigaddset(kd_lua_sigset *set, int signum);
int pthread_sigmask(int how, const kd_lua_sigset *set, kd_lua_sigset *old);
int sigtimedwait(const kd_lua_sigset *set, void *info, const kd_lua_timespec *timeout);
typedef void (*kd_lua_sighandler)(int);
kd_lua_sighandler signal(int signum, kd_lua_sighandler handler);
]])

local C = ffi.C
local SIGINT, SIG_BLOCK = 2, 0   -- Linux's numbers on x86-64 and aarch64

local set = ffi.new("kd_lua_sigset")
C.sigemptyset(set)
C.sigaddset(set, SIGINT)
local zero = ffi.new("kd_lua_timespec")

local I = {}

-- SIGINT stays pending from now on, in this thread and the threads it starts
function I.block() C.pthread_sigmask(SIG_BLOCK, set, nil) end

-- true when a SIGINT came since the last take (it is consumed)
function I.take() return C.sigtimedwait(set, nil, zero) == SIGINT end

-- from now on SIGINT is ignored: a pending one is discarded and later ones are too (POSIX
-- discards a pending signal, for every thread, once its action is set to ignore). For the way out
-- of the REPL, which must then end with os.exit(code, true): luajit's main sets SIGINT back to its
-- default action as soon as the script's main chunk returns, before it closes the state, and on
-- CUDA that close (the context teardown) takes about a second and may run threads that do not
-- block SIGINT; a Ctrl-C then ends the process with status 130 (reproduced on the CPU with a slow
-- teardown: repl_spec). The 130s repl_spec saw in CI and on the H200 on 2026-12-03 had another
-- cause, in the spec's harness: dash, script's shell there, waited in the terminal's foreground
-- group and died of the Ctrl-C itself (spec/helpers/terminal.lua now execs the command). A
-- thread that does not block SIGINT while the session runs would break the polling (luajit's own
-- handler would take the signal), so block() must still come before any thread starts.
function I.ignore() C.signal(SIGINT, ffi.cast("kd_lua_sighandler", 1)) end   -- 1 = SIG_IGN

return I
