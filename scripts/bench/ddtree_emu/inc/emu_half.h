/* emu_half.h: the device's 16-bit floats for the SIMT emulation, as the bits they store, converted
 * by the engine's own routines (cpu/cpu.h: round to nearest even, as the intrinsics) */
#pragma once
extern "C" {
#include "cpu/cpu.h"
}
struct bf16 { uint16_t bits; };
struct __half { uint16_t bits; };
inline float __bfloat162float(bf16 h) { return kd_bf16_to_f32(h.bits); }
inline bf16 __float2bfloat16(float f) { return bf16{kd_f32_to_bf16(f)}; }
inline float __half2float(__half h) { return kd_f16_to_f32(h.bits); }
inline __half __float2half(float f) { return __half{kd_f32_to_f16(f)}; }
