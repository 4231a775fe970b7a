/*
 * forkvm tiny test guest: a few KiB of x86_64 code that boots through the PVH
 * entry point in milliseconds and exercises what the VMM must get right.
 *
 * Every vCPU enters at pvh_start in 32-bit protected mode (the VMM starts the
 * application processors itself, at the same entry). Each CPU switches to long
 * mode on the shared static page tables, prints "tiny: cpu N up", takes
 * `ticks` LAPIC timer interrupts through the in-kernel irqchip, writes its id
 * to the forkvm probe port and prints "tiny: cpu N timer ok". The BSP waits
 * for every vCPU (count read from the probe port), prints
 * "tiny: all N cpus ok", optionally tests a memory pattern, then prints a
 * heartbeat "tiny: beat K" every `beat` ticks; with `exit=K` it resets
 * through the i8042 after K beats (the VMM then exits with status 0).
 *
 * Command line (PVH start_info), all optional, decimal:
 *   ticks=N   timer interrupts per CPU before it reports (default 10)
 *   beat=N    timer ticks (1 ms each) between heartbeats (default 100)
 *   exit=K    reset after K heartbeats (default: run forever)
 *   memtest=M fill M MiB from 16 MiB with an address pattern and verify it
 *   clonetest=N  fill 2 MiB with a pattern, ask the VMM for N clones through the
 *             clone port, then on every side check the inherited pattern, write its
 *             own, wait two beats and verify it ("tiny: clone K" first)
 *   done=1    with clonetest, each clone then writes its number to the done port
 *             (255 if its pattern was bad): its VMM exits with that status
 *   tickless=1  after the checks, the BSP masks its timer and halts for good
 *             (prints "tiny: tickless"); for benchmarks with many idle clones
 *   ud=1      after the checks, the BSP executes ud2 (tests of the exception report)
 *   probespin=1  after the checks, the BSP writes the probe port in a tight loop
 *             with interrupts off (clone benchmarks time a clone's first write)
 *   busy=1    every CPU spins instead of halting and prints "tiny: cpu N beat K"
 *             every `beat` ticks (exit= does not apply)
 *   dirty=M   after the checks, the BSP rewrites M MiB from 16 MiB every beat,
 *             printing "tiny: dirty pass K" (memory-limit tests)
 *   invoke=1  after the checks, the BSP masks its timer, prints "tiny: invoke ready"
 *             and serves invocations through the invoke port: an echo handler whose
 *             reply is the payload and a 48-byte trailer (the identity port's clone
 *             number, the request's sequence number, its 32 bytes of entropy); a
 *             payload starting with one of the words in docs/tiny-guest.md makes it
 *             fail, hang, crash or reply wrongly instead
 *   rewait=N  with invoke=1, after a read that returns "no request", spin N million
 *             TSC cycles before waiting again (a runtime slow to come back)
 *   prime=N   with invoke=1, declare prime requests in a wait header before each
 *             wait; 1: answer a prime request at once (no handler); 2: write the
 *             serial port first (a prime that leaves the serving path, for tests);
 *             3: never answer it (a prime that runs out of time, for tests); 4: arm
 *             the timer in TSC-deadline mode before the first wait, spin 400M cycles
 *             in the prime counting timer interrupts (a "tick" request returns that
 *             count and the count over such a spin of its own)
 *   hostile_virtio=N  after the checks, the BSP drives every virtio-mmio device
 *             badly for N rounds (needs 64 MiB of memory; see hostile_virtio below),
 *             then prints "tiny: hostile virtio done" and beats on
 *   load=1    with invoke=1, declare load requests in the wait header: a load
 *             request's first 8 payload bytes are kept, and a payload "show" is
 *             answered with them (a template derived from this one, for tests)
 *
 * See docs/tiny-guest.md.
 */

#define COM1            0x3f8
#define PROBE_PORT      0xf40   /* forkvm probe: read magic / write value */
#define PROBE_NCPUS     0xf44   /* forkvm probe: read number of vCPUs      */
#define LAPIC           0xfee00000
#define LAPIC_ID        0x20
#define LAPIC_EOI       0xb0
#define LAPIC_SVR       0xf0
#define LAPIC_LVT_TIMER 0x320
#define LAPIC_TIMER_ICR 0x380
#define LAPIC_TIMER_DCR 0x3e0
#define TIMER_VECTOR    0x20
#define MAX_CPUS        64
#define STACK_SIZE      8192
#define MEMTEST_BASE    0x1000000
#define CLONETEST_MIB   2
#define CLONE_PORT      0xf48   /* forkvm clone port: write count, read result */
#define DONE_PORT       0xf4c   /* forkvm done port: write exit status */
#define IDENTITY_PORT   0xf54   /* forkvm identity port: read the clone number */
#define INVOKE_PORT     0xf80   /* forkvm invoke port: read waits, write replies */
#define MAILBOX_ADDR_PORT 0xf84 /* forkvm: the mailbox's guest-physical address */
#define MAILBOX_SIZE_PORT 0xf88 /* forkvm: the mailbox's size */
#define REPLY_MAGIC     0x50524b46 /* "FKRP" */
#define WAIT_MAGIC      0x54574b46 /* "FKWT" */
#define TRAILER_BYTES   48
#define VIRTIO_MMIO     0xd0000000  /* forkvm's first virtio-mmio device, 4 KiB each */
#define VIRTIO_SLOTS    8
#define VIRTIO_MAGIC    0x74726976  /* "virt" */
#define HOSTILE_SCRATCH 0x2000000   /* queues and buffers of hostile_virtio: 32 MiB up */
#define HOSTILE_RAM_END 0x4000000   /* it needs 64 MiB of guest memory */

    .code32
    .section .text.entry, "ax"
    .globl pvh_start
pvh_start:
    cli
    cld
    movl %ebx, %esi                 /* start_info, kept for the BSP */
    movl $1, %eax
    cpuid
    shrl $24, %ebx                  /* initial APIC id */
    movl %ebx, %edi
    /* stack: top of this CPU's slot */
    leal 1(%ebx), %eax
    shll $13, %eax
    addl $stacks, %eax
    movl %eax, %esp

    lgdt gdt_desc
    movl %cr4, %eax
    orl  $0x20, %eax                /* PAE */
    movl %eax, %cr4
    movl $pml4, %eax
    movl %eax, %cr3
    movl $0xc0000080, %ecx          /* EFER.LME */
    rdmsr
    orl  $0x100, %eax
    wrmsr
    movl %cr0, %eax
    orl  $0x80000001, %eax          /* PG | PE */
    movl %eax, %cr0
    ljmp $0x08, $long_entry

    .code64
long_entry:
    movl $0x10, %eax
    movl %eax, %ds
    movl %eax, %es
    movl %eax, %ss
    xorl %eax, %eax
    movl %eax, %fs
    movl %eax, %gs
    movl %edi, %r15d                /* r15 = cpu (APIC) id for the whole run */
    movl %esi, %r14d                /* r14 = start_info */

    /* First line as early as possible: boot benchmarks measure up to here. */
    leaq msg_cpu(%rip), %rdi
    call lock_print_cpu_msg         /* "tiny: cpu N up" */

    testl %r15d, %r15d
    jnz  ap_wait_idt
    call build_idt
    call parse_cmdline
    /* Mask both legacy PICs (OCW1): the guest takes its interrupts from the LAPIC, and
       an unprogrammed PIC would deliver a device's IRQ N as exception vector N (a
       Firecracker restore raises IRQ 5 for its VMGenID device). */
    movb $0xff, %al
    outb %al, $0xa1
    outb %al, $0x21
    movl $1, idt_ready(%rip)
    jmp  cpu_common
ap_wait_idt:
    pause
    cmpl $0, idt_ready(%rip)
    je   ap_wait_idt

cpu_common:
    lidt idt_desc(%rip)

    /* LAPIC: enable, periodic timer at 1 kHz (KVM's APIC bus is 1 GHz: /16, 62500). */
    movl $LAPIC, %ebx
    movl $0x1ff, LAPIC_SVR(%rbx)
    movl $0x3, LAPIC_TIMER_DCR(%rbx)
    movl $(TIMER_VECTOR | (1 << 17)), LAPIC_LVT_TIMER(%rbx)
    movl $62500, LAPIC_TIMER_ICR(%rbx)
    sti

    movq opt_ticks(%rip), %r13
1:  hlt
    leaq ticks(%rip), %rax
    cmpq %r13, (%rax,%r15,8)
    jb   1b

    movl $PROBE_PORT, %edx
    leal 0x100(%r15), %eax          /* probe value: 0x100 + cpu id */
    outl %eax, %dx
    leaq msg_timer(%rip), %rdi
    call lock_print_cpu_msg         /* "tiny: cpu N timer ok" */
    lock incl cpus_done(%rip)
    cmpq $0, opt_hostile(%rip)
    je   1f
    call hostile
1:

    testl %r15d, %r15d
    jz   bsp_main
    cmpq $0, opt_busy(%rip)
    jne  busy_beats
ap_idle:
    hlt
    jmp  ap_idle

/*
 * busy=1: this CPU never halts. It spins reading its tick count and prints
 * "tiny: cpu N beat K" every `beat` ticks, so every vCPU is running guest code
 * whenever the VMM stops it (for a clone, say).
 */
busy_beats:
    xorl %r12d, %r12d               /* beats so far */
    leaq ticks(%rip), %rax
    movq (%rax,%r15,8), %r13        /* tick count at last beat */
1:  pause
    leaq ticks(%rip), %rax
    movq (%rax,%r15,8), %rax
    subq %r13, %rax
    cmpq opt_beat(%rip), %rax
    jb   1b
    addq %rax, %r13
    incq %r12
    call lock_serial
    leaq msg_cpu_prefix(%rip), %rdi
    call puts
    movq %r15, %rdi
    call putdec
    leaq msg_cpu_beat(%rip), %rdi
    call puts
    movq %r12, %rdi
    call putdec
    movb $'\n', %dil
    call putc
    call unlock_serial
    jmp  1b

#include "hostile.S"

bsp_main:
    movl $PROBE_NCPUS, %edx
    inl  %dx, %eax
    movl %eax, %r12d                /* r12 = expected vCPUs */
1:  cmpl %r12d, cpus_done(%rip)
    jae  2f
    hlt
    jmp  1b
2:  call lock_serial
    leaq msg_all(%rip), %rdi
    call puts
    movl %r12d, %edi
    call putdec
    leaq msg_cpus_ok(%rip), %rdi
    call puts
    call unlock_serial

    movq opt_memtest(%rip), %rcx
    testq %rcx, %rcx
    jz   1f
    call memtest
1:  movq opt_clonetest(%rip), %rcx
    testq %rcx, %rcx
    jz   1f
    call clonetest
1:  cmpq $0, opt_hostile_virtio(%rip)
    je   1f
    call hostile_virtio
1:  cmpq $0, opt_ud(%rip)
    je   1f
    ud2                             /* ud=1: an invalid opcode, vector 6 */
1:  cmpq $0, opt_dirty(%rip)
    jne  dirty_loop
    cmpq $0, opt_busy(%rip)
    jne  busy_beats
    cmpq $0, opt_probespin(%rip)
    jne  probe_spin
    cmpq $0, opt_invoke(%rip)
    jne  invoke_loop
    cmpq $0, opt_tickless(%rip)
    je   heartbeat
    /* tickless=1: stop this CPU's timer and halt for good (idle clones cost nothing). */
    movl $LAPIC, %ebx
    movl $(TIMER_VECTOR | (1 << 16)), LAPIC_LVT_TIMER(%rbx)
    leaq msg_tickless(%rip), %rdi
    call lock_serial
    call puts
    call unlock_serial
6:  hlt
    jmp  6b

heartbeat:
    xorl %r12d, %r12d               /* beats so far */
    movq ticks(%rip), %r13          /* BSP tick count at last beat */
1:  call wait_beat
    incq %r12
    leaq msg_beat(%rip), %rdi
    movq %r12, %rsi
    call print_num_line
    movq opt_exit(%rip), %rax
    testq %rax, %rax
    jz   1b
    cmpq %rax, %r12
    jb   1b
    /* i8042 reset pulse: the VMM treats it as a power-off with status 0. */
    leaq msg_reset(%rip), %rdi
    call puts
    movb $0xfe, %al
    outb %al, $0x64
2:  cli
    hlt
    jmp  2b

/* fill_pattern: every quadword of [MEMTEST_BASE, +rcx MiB) = its address ^ r11. */
fill_pattern:
    shlq $17, %rcx                  /* MiB -> quadwords */
    movq $MEMTEST_BASE, %rdi
1:  movq %rdi, %rax
    xorq %r11, %rax
    movq %rax, (%rdi)
    addq $8, %rdi
    decq %rcx
    jnz  1b
    ret

/* check_pattern: r10 = quadwords of [MEMTEST_BASE, +rcx MiB) not equal to address ^ r11. */
check_pattern:
    shlq $17, %rcx
    movq $MEMTEST_BASE, %rsi
    xorl %r10d, %r10d
1:  movq %rsi, %rax
    xorq %r11, %rax
    cmpq %rax, (%rsi)
    je   2f
    incq %r10
2:  addq $8, %rsi
    decq %rcx
    jnz  1b
    ret

/* print_result: prints rdi (message), r8 (number), then " ok" or " BAD quadwords=r10". */
print_result:
    pushq %rdi
    call lock_serial
    popq %rdi
    call puts
    movq %r8, %rdi
    call putdec
    testq %r10, %r10
    jnz  1f
    leaq msg_ok(%rip), %rdi
    call puts
    jmp  2f
1:  leaq msg_bad(%rip), %rdi
    call puts
    movq %r10, %rdi
    call putdec
    movb $'\n', %dil
    call putc
2:  call unlock_serial
    ret

/*
 * probespin=1: the BSP writes the probe port in a tight loop with interrupts off, so a
 * clone's first probe write marks, within microseconds, when its guest code ran again.
 */
probe_spin:
    cli
    movl $PROBE_PORT, %edx
1:  movl $0x5,  %eax
    outl %eax, %dx
    jmp  1b

/*
 * invoke=1: serve invocations (docs/invoke.md). r15 = mailbox, r14 = its size.
 * Each request: eax = payload length from the invoke port (all ones: no request, wait
 * again); the first 4 payload bytes pick the behaviour; the default echoes.
 */
invoke_loop:
    movl $LAPIC, %ebx
    movl $(TIMER_VECTOR | (1 << 16)), LAPIC_LVT_TIMER(%rbx)
    cmpq $4, opt_prime(%rip)
    jne  1f
    /* prime=4: the timer in TSC-deadline mode, unmasked, due 100M cycles from now:
       armed when the template pauses, and due by the time its clones run. */
    movl $(TIMER_VECTOR | (2 << 17)), LAPIC_LVT_TIMER(%rbx)
    rdtsc
    shlq $32, %rdx
    orq  %rdx, %rax
    addq $100000000, %rax
    movq %rax, %rdx
    shrq $32, %rdx
    movl $0x6e0, %ecx               /* IA32_TSC_DEADLINE */
    wrmsr
1:
    movl $MAILBOX_ADDR_PORT, %edx
    inl  %dx, %eax
    movl %eax, %r15d
    movl $MAILBOX_SIZE_PORT, %edx
    inl  %dx, %eax
    movl %eax, %r14d
    leaq msg_invoke(%rip), %rdi
    call lock_serial
    call puts
    call unlock_serial
1:  xorl %eax, %eax                 /* the features: 1 prime, 2 load */
    cmpq $0, opt_prime(%rip)
    je   8f
    orl  $1, %eax
8:  cmpq $0, opt_load(%rip)
    je   9f
    orl  $2, %eax
9:  testl %eax, %eax
    je   6f
    movl $WAIT_MAGIC, (%r15)        /* the wait header, with the features */
    movl $1, 4(%r15)                /* version 1, 2 bytes zero */
    movl %eax, 8(%r15)
6:  movl $INVOKE_PORT, %edx
    inl  %dx, %eax                  /* parks until a request is in the mailbox */
    cmpl $0xffffffff, %eax
    jne  5f
    call rewait_spin                /* no request: wait again, after rewait= */
    jmp  1b
5:  movl %eax, %ecx                 /* rcx = payload length */
    cmpw $2, 6(%r15)                /* a prime request: no handler */
    je   inv_prime
    cmpw $3, 6(%r15)                /* a load request: keep its first 8 bytes */
    je   inv_load
    xorl %eax, %eax
    cmpl $4, %ecx
    jb   2f
    movl 64(%r15), %eax             /* the payload's first word */
2:  cmpl $0x6c696166, %eax          /* "fail": the handler fails */
    je   inv_fail
    cmpl $0x676e6168, %eax          /* "hang": never replies */
    je   inv_hang
    cmpl $0x66666f70, %eax          /* "poff": powers off */
    je   inv_poweroff
    cmpl $0x68737263, %eax          /* "crsh": triple fault */
    je   inv_crash
    cmpl $0x62726167, %eax          /* "garb": garbage header */
    je   inv_garbage
    cmpl $0x6c676962, %eax          /* "bigl": a length past the mailbox */
    je   inv_biglen
    cmpl $0x656e6f64, %eax          /* "done": ends the VM with status 7 */
    je   inv_done
    cmpl $0x776f6873, %eax          /* "show": the loaded 8 bytes */
    je   inv_show
    cmpl $0x6b636974, %eax          /* "tick": timer interrupts in the prime, then here */
    je   inv_tick
    cmpl $0x6b636174, %eax          /* "tack": the same over a spin within the deferral */
    je   inv_tack
    cmpl $0x6c6c6966, %eax          /* "fill": writes memory, then the echo */
    je   inv_fill
inv_echo:                           /* the payload stays where it is; the trailer after it */
    leaq 64(%r15,%rcx), %rdi
    movl $IDENTITY_PORT, %edx
    inl  %dx, %eax
    movq %rax, (%rdi)
    movq 16(%r15), %rax             /* the request's sequence number */
    movq %rax, 8(%rdi)
    leaq 32(%r15), %rsi             /* its entropy */
    addq $16, %rdi
    movl %ecx, %r8d
    movl $32, %ecx
    rep movsb
    leal TRAILER_BYTES(%r8), %ecx
    xorl %eax, %eax                 /* status ok */
inv_reply:                          /* ecx = length, eax = status */
    movl $REPLY_MAGIC, (%r15)
    movw $1, 4(%r15)
    movw %ax, 6(%r15)
    movl %ecx, 8(%r15)
    movl %ecx, %eax
    movl $INVOKE_PORT, %edx
    outl %eax, %dx                  /* parks until the VMM took the reply */
    jmp  1b
inv_fill:                           /* "fill" N O: N MiB from MEMTEST_BASE + O MiB */
    cmpl $6, %ecx
    jb   inv_echo
    movq %rcx, %r8
    movzbl 69(%r15), %edi           /* O */
    shlq $20, %rdi
    addq $MEMTEST_BASE, %rdi
    movzbl 68(%r15), %ecx           /* N */
    shlq $17, %rcx                  /* MiB -> quadwords */
    movq 16(%r15), %rax             /* the request's sequence number */
    cld
    rep stosq                       /* one instruction: cheap where CPL 0 is emulated */
    movq %r8, %rcx
    jmp  inv_echo
inv_load:
    movq 64(%r15), %rax
    movq %rax, loaded(%rip)
    xorl %ecx, %ecx
    xorl %eax, %eax
    jmp  inv_reply
inv_show:
    movq loaded(%rip), %rax
    movq %rax, 64(%r15)
    movl $8, %ecx
    xorl %eax, %eax
    jmp  inv_reply
inv_tick:                           /* 16 bytes: those of the prime, those of a spin */
    movq $400000000, %r8
    jmp  2f
inv_tack:                           /* a spin of 16M cycles: shorter than a deferral */
    movq $16000000, %r8
2:  call tick_spin_n
    movq %rax, 72(%r15)
    movq prime_ticks(%rip), %rax
    movq %rax, 64(%r15)
    movl $16, %ecx
    xorl %eax, %eax
    jmp  inv_reply
inv_prime:
    cmpq $3, opt_prime(%rip)        /* prime=3: spin until the prime's time is up */
    jne  6f
8:  pause
    jmp  8b
6:  cmpq $4, opt_prime(%rip)        /* prime=4: spin, counting timer interrupts */
    jne  9f
    call tick_spin
    movq %rax, prime_ticks(%rip)
    jmp  7f
9:  cmpq $2, opt_prime(%rip)
    jne  7f
    movb $'!', %al                  /* prime=2: a port the prime may not use */
    movw $COM1, %dx
    outb %al, %dx
7:  xorl %ecx, %ecx
    xorl %eax, %eax
    jmp  inv_reply
inv_fail:
    leaq msg_failed(%rip), %rsi
    leaq 64(%r15), %rdi
    movl $(msg_failed_end - msg_failed), %ecx
    rep movsb
    movl $(msg_failed_end - msg_failed), %ecx
    movl $1, %eax
    jmp  inv_reply
inv_hang:
    sti
3:  hlt
    jmp  3b
inv_poweroff:
    movb $0xfe, %al
    outb %al, $0x64
    jmp  inv_hang
inv_crash:
    lidt null_idt(%rip)
    int3
inv_garbage:
    movq $0x5555555555555555, %rax
    movq %rax, (%r15)
    movq %rax, 8(%r15)
    movl %ecx, %eax
    movl $INVOKE_PORT, %edx
    outl %eax, %dx
    jmp  1b
inv_biglen:
    movl $0x7fffffff, %ecx
    xorl %eax, %eax
    jmp  inv_reply
inv_done:
    movl $7, %eax
    movl $DONE_PORT, %edx
    outl %eax, %dx
    jmp  inv_hang

/*
 * rewait=N: spins N million TSC cycles (none without the option). Clobbers rax, rdx, r8.
 */
rewait_spin:
    movq opt_rewait(%rip), %r8
    testq %r8, %r8
    jz   1f
    imulq $1000000, %r8, %r8
    jmp  spin_cycles
1:  ret

/*
 * tick_spin: spins 400M TSC cycles with interrupts on (prime=4's tests: longer than a
 * request's timer deferral, shorter than a prime's limit); returns in rax the timer
 * interrupts this CPU took meanwhile. tick_spin_n spins r8 cycles. Clobbers rdx, r8, r9.
 */
tick_spin:
    movq $400000000, %r8
tick_spin_n:
    movq ticks(%rip), %r9           /* the BSP's count (invocations run on it) */
    sti
    call spin_cycles
    movq ticks(%rip), %rax
    subq %r9, %rax
    ret

/* spin_cycles: spins r8 TSC cycles. Clobbers rax, rdx, r8. */
spin_cycles:
    rdtsc
    shlq $32, %rdx
    orq  %rdx, %rax
    addq %rax, %r8                  /* r8 = the TSC to wait for */
1:  pause
    rdtsc
    shlq $32, %rdx
    orq  %rdx, %rax
    cmpq %r8, %rax
    jb   1b
    ret

/*
 * dirty=M: rewrites M MiB from MEMTEST_BASE every beat with the pass number and prints
 * "tiny: dirty pass K". In a clone the first pass copies all M MiB (memory-limit tests).
 */
dirty_loop:
    xorl %r12d, %r12d
1:  incq %r12
    movq %r12, %rax
    movq opt_dirty(%rip), %rcx
    shlq $17, %rcx                  /* MiB -> quadwords */
    movq $MEMTEST_BASE, %rdi
    cld
    rep stosq                       /* one instruction: cheap where CPL 0 is emulated */
    leaq msg_dirty(%rip), %rdi
    movq %r12, %rsi
    call print_num_line
    movq ticks(%rip), %r13          /* the next pass a beat after this one ended */
    call wait_beat
    jmp  1b

/* memtest: rcx = MiB. Fill with the address pattern, verify, print result. */
memtest:
    movq %rcx, %r8
    xorl %r11d, %r11d
    call fill_pattern
    movq %r8, %rcx
    call check_pattern
    leaq msg_memtest(%rip), %rdi
    jmp  print_result

/*
 * clonetest: rcx = clones to ask for. Fills CLONETEST_MIB with the key-0 pattern,
 * asks the VMM for the clones through the clone port, and on each side (k = 0 in
 * the parent, the clone's number in a clone): checks the inherited key-0 pattern,
 * writes its own key, waits two beats so siblings write theirs, and verifies it.
 */
clonetest:
    pushq %rcx
    movl $CLONETEST_MIB, %ecx
    xorl %r11d, %r11d
    call fill_pattern
    popq %rax
    movl $CLONE_PORT, %edx
    outl %eax, %dx                  /* how many */
    inl  %dx, %eax                  /* clone: 0 parent, k clone, ~0 failed */
    movl %eax, %r9d
    cmpl $0xffffffff, %r9d
    jne  1f
    leaq msg_clone_failed(%rip), %rdi
    call lock_serial
    call puts
    call unlock_serial
    ret
1:  leaq msg_clone(%rip), %rdi
    movq %r9, %rsi
    call print_num_line
    movl $CLONETEST_MIB, %ecx
    xorl %r11d, %r11d
    call check_pattern
    movq %r9, %r8
    leaq msg_inherit(%rip), %rdi
    call print_result
    movq %r9, %r11
    movabsq $0x9e3779b97f4a7c15, %rax
    imulq %rax, %r11                /* key = k * golden ratio */
    pushq %r11
    movl $CLONETEST_MIB, %ecx
    call fill_pattern
    movq ticks(%rip), %r13          /* wait two beats */
    movq opt_beat(%rip), %rax
    addq %rax, %rax
    addq %rax, %r13
2:  hlt
    cmpq %r13, ticks(%rip)
    jb   2b
    popq %r11
    movl $CLONETEST_MIB, %ecx
    call check_pattern
    movq %r9, %r8
    leaq msg_own(%rip), %rdi
    call print_result
    /* done=1: a clone reports its number as its exit status (255 if the pattern
       was bad) through the done port; the parent carries on. */
    cmpq $0, opt_done(%rip)
    je   3f
    testq %r9, %r9
    jz   3f
    movl %r9d, %eax
    testq %r10, %r10
    jz   4f
    movl $255, %eax
4:  movl $DONE_PORT, %edx
    outl %eax, %dx
5:  hlt
    jmp  5b
3:  ret

/* ---------------------------------------------------------------- interrupts */
build_idt:
    leaq idt(%rip), %rdi
    xorl %ecx, %ecx
1:  movl %ecx, %eax                 /* unexpected_stubs + 16 * vector */
    shll $4, %eax
    leaq unexpected_stubs(%rip), %r8
    addq %r8, %rax
    cmpl $TIMER_VECTOR, %ecx
    jne  2f
    leaq isr_timer(%rip), %rax
2:  cmpl $0xff, %ecx
    jne  3f
    leaq isr_spurious(%rip), %rax
3:  movw %ax, (%rdi)
    movw $0x08, 2(%rdi)
    movw $0x8e00, 4(%rdi)
    shrq $16, %rax
    movw %ax, 6(%rdi)
    shrq $16, %rax
    movl %eax, 8(%rdi)
    movl $0, 12(%rdi)
    addq $16, %rdi
    incl %ecx
    cmpl $256, %ecx
    jb   1b
    ret

isr_timer:
    pushq %rax
    pushq %rbx
    movl $LAPIC, %ebx
    movl LAPIC_ID(%rbx), %eax
    shrl $24, %eax
    leaq ticks(%rip), %rbx
    incq (%rbx,%rax,8)
    movl $LAPIC, %ebx
    movl $0, LAPIC_EOI(%rbx)
    popq %rbx
    popq %rax
    iretq

isr_spurious:
    iretq

/* One 16-byte stub per vector, which passes its vector to isr_unexpected. */
    .balign 16
unexpected_stubs:
    .set vector, 0
    .rept 256
    .balign 16
    movl $vector, %edi
    jmp  isr_unexpected
    .set vector, vector + 1
    .endr

/* isr_unexpected: edi = vector. Prints "tiny: unexpected exception N" without the
   serial lock (the CPU may hold it), reports 0xdead and halts this CPU. */
isr_unexpected:
    pushq %rdi
    leaq msg_unexpected(%rip), %rdi
    call puts
    popq %rdi
    call putdec
    movb $'\n', %dil
    call putc
    movl $PROBE_PORT, %edx
    movl $0xdead, %eax
    outl %eax, %dx
1:  cli
    hlt
    jmp  1b

/* ---------------------------------------------------------------- serial */
lock_serial:
    lock btsl $0, serial_lock(%rip)
    jnc  2f
1:  pause
    testl $1, serial_lock(%rip)
    jnz  1b
    jmp  lock_serial
2:  ret

unlock_serial:
    movl $0, serial_lock(%rip)
    ret

/* putc: dil = byte. Waits for THR empty. */
putc:
    movw $(COM1 + 5), %dx
1:  inb  %dx, %al
    testb $0x20, %al
    jz   1b
    movw $COM1, %dx
    movb %dil, %al
    outb %al, %dx
    ret

/* puts: rdi = NUL-terminated string */
puts:
    pushq %rbx
    movq %rdi, %rbx
1:  movb (%rbx), %dil
    testb %dil, %dil
    jz   2f
    call putc
    incq %rbx
    jmp  1b
2:  popq %rbx
    ret

/* putdec: rdi = unsigned value */
putdec:
    subq $32, %rsp
    movq %rdi, %rax
    leaq 31(%rsp), %rsi
    movb $0, (%rsi)
    movl $10, %ecx
1:  xorl %edx, %edx
    divq %rcx
    addb $'0', %dl
    decq %rsi
    movb %dl, (%rsi)
    testq %rax, %rax
    jnz  1b
    movq %rsi, %rdi
    call puts
    addq $32, %rsp
    ret

/* print_num_line: prints the string at rdi, the number in rsi and a newline, holding
   the serial lock. Clobbers rax, rcx, rdx, rsi, rdi (as putdec). */
print_num_line:
    pushq %rsi
    pushq %rdi
    call lock_serial
    popq %rdi
    call puts
    popq %rdi
    call putdec
    movb $'\n', %dil
    call putc
    jmp  unlock_serial

/* wait_beat: halts until `beat` ticks have passed since r13 (the BSP's tick count at
   the last beat), then moves r13 on by the ticks that passed. Clobbers rax. */
wait_beat:
1:  hlt
    movq ticks(%rip), %rax
    subq %r13, %rax
    cmpq opt_beat(%rip), %rax
    jb   1b
    addq %rax, %r13
    ret

/* lock_print_cpu_msg: prints "tiny: cpu <r15>" then the string at rdi. */
lock_print_cpu_msg:
    pushq %rdi
    call lock_serial
    leaq msg_cpu_prefix(%rip), %rdi
    call puts
    movq %r15, %rdi
    call putdec
    popq %rdi
    call puts
    call unlock_serial
    ret

/* ---------------------------------------------------------------- command line */
/* parse_cmdline: reads ticks=, beat=, exit=, memtest= from start_info (r14). */
parse_cmdline:
    movq 24(%r14), %rsi             /* hvm_start_info.cmdline_paddr */
    testq %rsi, %rsi
    jz   9f
    leaq key_ticks(%rip), %rdi
    leaq opt_ticks(%rip), %rdx
    call cmdline_opt
    leaq key_beat(%rip), %rdi
    leaq opt_beat(%rip), %rdx
    call cmdline_opt
    leaq key_exit(%rip), %rdi
    leaq opt_exit(%rip), %rdx
    call cmdline_opt
    leaq key_memtest(%rip), %rdi
    leaq opt_memtest(%rip), %rdx
    call cmdline_opt
    leaq key_busy(%rip), %rdi
    leaq opt_busy(%rip), %rdx
    call cmdline_opt
    leaq key_clonetest(%rip), %rdi
    leaq opt_clonetest(%rip), %rdx
    call cmdline_opt
    leaq key_done(%rip), %rdi
    leaq opt_done(%rip), %rdx
    call cmdline_opt
    leaq key_tickless(%rip), %rdi
    leaq opt_tickless(%rip), %rdx
    call cmdline_opt
    leaq key_probespin(%rip), %rdi
    leaq opt_probespin(%rip), %rdx
    call cmdline_opt
    leaq key_ud(%rip), %rdi
    leaq opt_ud(%rip), %rdx
    call cmdline_opt
    leaq key_dirty(%rip), %rdi
    leaq opt_dirty(%rip), %rdx
    call cmdline_opt
    leaq key_invoke(%rip), %rdi
    leaq opt_invoke(%rip), %rdx
    call cmdline_opt
    leaq key_rewait(%rip), %rdi
    leaq opt_rewait(%rip), %rdx
    call cmdline_opt
    leaq key_prime(%rip), %rdi
    leaq opt_prime(%rip), %rdx
    call cmdline_opt
    leaq key_load(%rip), %rdi
    leaq opt_load(%rip), %rdx
    call cmdline_opt
    leaq key_hostile(%rip), %rdi
    leaq opt_hostile(%rip), %rdx
    call cmdline_opt
    leaq key_hostile_virtio(%rip), %rdi
    leaq opt_hostile_virtio(%rip), %rdx
    call cmdline_opt
9:  ret

/*
 * cmdline_opt: rsi = command line, rdi = "key=", rdx = u64 to store into.
 * Matches the key at the start of a word; stores the decimal value after it.
 */
cmdline_opt:
    pushq %rsi
    movq %rsi, %r8                  /* word start candidate */
1:  movq %r8, %r9
    movq %rdi, %r10
2:  movb (%r10), %al
    testb %al, %al
    jz   found                      /* whole key matched */
    cmpb (%r9), %al
    jne  next_word
    incq %r9
    incq %r10
    jmp  2b
next_word:
    movb (%r8), %al
    testb %al, %al
    jz   done
    incq %r8
    cmpb $' ', %al
    jne  next_word
    jmp  1b
found:
    xorl %eax, %eax
3:  movzbl (%r9), %ecx
    subl $'0', %ecx
    cmpl $9, %ecx
    ja   4f
    imulq $10, %rax
    addq %rcx, %rax
    incq %r9
    jmp  3b
4:  movq %rax, (%rdx)
done:
    popq %rsi
    ret

/* ---------------------------------------------------------------- data */
    .section .rodata
msg_cpu_prefix: .asciz "tiny: cpu "
msg_cpu:        .asciz " up\n"
msg_cpu_beat:   .asciz " beat "
msg_timer:      .asciz " timer ok\n"
msg_all:        .asciz "tiny: all "
msg_cpus_ok:    .asciz " cpus ok\n"
msg_beat:       .asciz "tiny: beat "
msg_reset:      .asciz "tiny: reset\n"
msg_memtest:    .asciz "tiny: memtest MiB="
msg_ok:         .asciz " ok\n"
msg_bad:        .asciz " BAD quadwords="
msg_clone:      .asciz "tiny: clone "
msg_tickless:   .asciz "tiny: tickless\n"
msg_clone_failed: .asciz "tiny: clone failed\n"
msg_inherit:    .asciz "tiny: inherited pattern, clone "
msg_own:        .asciz "tiny: own pattern, clone "
msg_unexpected: .asciz "tiny: unexpected exception "
key_ticks:      .asciz "ticks="
key_beat:       .asciz "beat="
key_exit:       .asciz "exit="
key_memtest:    .asciz "memtest="
key_busy:       .asciz "busy="
key_clonetest:  .asciz "clonetest="
key_done:       .asciz "done="
key_tickless:   .asciz "tickless="
key_probespin:  .asciz "probespin="
key_ud:         .asciz "ud="
key_dirty:      .asciz "dirty="
msg_dirty:      .asciz "tiny: dirty pass "
key_invoke:     .asciz "invoke="
msg_invoke:     .asciz "tiny: invoke ready\n"
key_rewait:     .asciz "rewait="
key_prime:      .asciz "prime="
key_load:       .asciz "load="
key_hostile:    .asciz "hostile="
msg_hostile:    .asciz " hostile done\n"
key_hostile_virtio: .asciz "hostile_virtio="
msg_hv_start:   .asciz "tiny: hostile virtio start\n"
msg_hv_done:    .asciz "tiny: hostile virtio done\n"
msg_failed:     .ascii "tiny: the handler failed"
msg_failed_end:
null_idt:
    .word 0
    .quad 0

    .align 16
gdt:
    .quad 0
    .quad 0x00af9a000000ffff        /* 0x08: 64-bit code */
    .quad 0x00cf92000000ffff        /* 0x10: data */
gdt_end:
gdt_desc:
    .word gdt_end - gdt - 1
    .quad gdt
idt_desc:
    .word 256 * 16 - 1
    .quad idt

    .section .data
    .align 8
opt_ticks:   .quad 10
opt_beat:    .quad 100
opt_exit:    .quad 0
opt_memtest: .quad 0
opt_busy:    .quad 0
opt_clonetest: .quad 0
opt_done:    .quad 0
opt_tickless: .quad 0
opt_probespin: .quad 0
opt_ud:        .quad 0
opt_dirty:   .quad 0
opt_invoke:  .quad 0
opt_rewait:  .quad 0
opt_prime:   .quad 0
opt_load:    .quad 0
opt_hostile: .quad 0
opt_hostile_virtio: .quad 0
loaded:      .quad 0
prime_ticks: .quad 0
idt_ready:   .long 0
cpus_done:   .long 0
serial_lock: .long 0

    /* Identity map of the first 4 GiB with 2 MiB pages (LAPIC MMIO included). */
    .section .data.pagetables, "aw"
    .align 4096
pml4:
    .quad pdpt + 0x7
    .fill 511, 8, 0
pdpt:
    .quad pd + 0x7
    .quad pd + 0x1000 + 0x7
    .quad pd + 0x2000 + 0x7
    .quad pd + 0x3000 + 0x7
    .fill 508, 8, 0
pd:
    .set i, 0
    .rept 2048
    .quad (i << 21) | 0x87
    .set i, i + 1
    .endr

    .section .bss
    .align 4096
idt:    .skip 256 * 16
ticks:  .skip MAX_CPUS * 8
    .align 4096
stacks: .skip (MAX_CPUS + 1) * STACK_SIZE

    /* PVH entry point note (XEN_ELFNOTE_PHYS32_ENTRY). */
    .section .note.pvh, "a", @note
    .align 4
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .align 4
    .long pvh_start
    .align 4
