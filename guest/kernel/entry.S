/* entry.S - boot entry, interrupt and syscall entry, and the one return path.
 *
 * Every way into the kernel (interrupts, exceptions, and syscalls, which are
 * `ud2` from CPL3, see trap.c) builds the same struct frame (kernel.h) on the
 * stack and calls trap_dispatch(frame); every way out pops a frame and runs iretq.
 * The scheduler switches tasks by overwriting that frame, so there is exactly
 * one kernel stack per vCPU and no kernel-side context switch. */
#include "ferry_abi.h"

        .section .text.entry, "ax"
        .code64
        .globl _start
_start:
        /* The VMM enters here on every vCPU: rdi = cpu id, rsp = boot stack. */
        cld
        call kmain
1:      hlt
        jmp 1b

        .text
        /* 256 stubs of 16 bytes; those without a CPU error code push a zero. */
        .align 16
        .globl isr_stubs
isr_stubs:
        .set i, 0
        .rept 256
        .align 16
        .if (i == 8) || ((i >= 10) && (i <= 14)) || (i == 17) || (i == 21) || (i == 29) || (i == 30)
        .else
        pushq $0
        .endif
        pushq $i
        jmp trap_common
        .set i, i + 1
        .endr

trap_common:
        pushq %rax; pushq %rbx; pushq %rcx; pushq %rdx; pushq %rsi; pushq %rdi; pushq %rbp
        pushq %r8; pushq %r9; pushq %r10; pushq %r11; pushq %r12; pushq %r13; pushq %r14; pushq %r15
        movq %rsp, %rdi
        call trap_dispatch
        .globl trap_return
trap_return:
        popq %r15; popq %r14; popq %r13; popq %r12; popq %r11; popq %r10; popq %r9; popq %r8
        popq %rbp; popq %rdi; popq %rsi; popq %rdx; popq %rcx; popq %rbx; popq %rax
        addq $16, %rsp
        iretq

        /* enter_frame(frame): start running the context described by *frame. */
        .globl enter_frame
enter_frame:
        movq %rdi, %rsp
        jmp trap_return

        /* The idle context: CPL0, interrupts on, halted until the next interrupt. */
        .globl idle_loop
idle_loop:
        sti
        hlt
        jmp idle_loop

        /* First instruction of every task (CPL3): rdi = task context, rsi = entry. */
        .globl user_trampoline
user_trampoline:
        call *%rsi
        movl $0, %eax           /* SYS_EXIT */
        ud2                     /* syscall */
