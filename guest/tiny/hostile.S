/*
 * The tiny guest's hostile modes (docs/tiny-guest.md), included by tiny.S into its
 * text: hostile=N (random port accesses from every vCPU) and hostile_virtio=N (a
 * virtio driver that does everything wrong). They use tiny.S's constants, options and
 * serial routines.
 */
/*
 * hostile=N: N thousand port accesses at random from this CPU (a xorshift64 seeded
 * from the TSC and the CPU id) to ports 0xf40-0xfbf, forkvm's and unused ones, at
 * any offset, except the done port and the invoke port (which end or park the VM by
 * design): 32-bit writes of random values, one access in four a read. Then
 * "tiny: cpu N hostile done" (malicious-guest tests).
 */
hostile:
    rdtsc
    shlq $32, %rdx
    orq  %rdx, %rax
    leaq 1(%rax,%r15), %r8          /* r8: generator state, never 0 */
    movq opt_hostile(%rip), %r9
    imulq $1000, %r9, %r9           /* r9: accesses left */
1:  call xorshift
    movl %r8d, %edx
    andl $0x7f, %edx
    addl $0xf40, %edx               /* port 0xf40-0xfbf */
    cmpl $DONE_PORT, %edx
    je   3f
    cmpl $INVOKE_PORT, %edx
    je   3f
    movq %r8, %rax
    shrq $32, %rax                  /* value */
    testl $0x300, %r8d
    jz   2f
    outl %eax, %dx
    jmp  3f
2:  inl  %dx, %eax
3:  decq %r9
    jnz  1b
    leaq msg_hostile(%rip), %rdi
    call lock_print_cpu_msg         /* "tiny: cpu N hostile done" */
    ret

/* xorshift64: r8 = its next state, also in rax. Clobbers nothing else. */
xorshift:
    movq %r8, %rax
    shlq $13, %rax
    xorq %rax, %r8
    movq %r8, %rax
    shrq $7, %rax
    xorq %rax, %r8
    movq %r8, %rax
    shlq $17, %rax
    xorq %rax, %r8
    movq %r8, %rax
    ret

/*
 * hostile_virtio=N: a driver that does everything wrong, N rounds. Each round, every
 * virtio-mmio device found (magic value at VIRTIO_MMIO + 4 KiB * slot) is reset and
 * brought to DRIVER_OK with random driver features and, for queues 0-2, sizes 1 to
 * 256 (one in eight random) and rings at HOSTILE_SCRATCH + 16 KiB * queue (one in eight
 * at a random address above 2 GiB, outside memory). Then 16 times: the descriptor
 * tables and available rings are filled at random while the device may be reading them:
 * buffer addresses in the scratch area, or running past the end of memory (one in
 * eight), or beyond 1 TiB (one in eight); lengths up to 1 KiB or any 32-bit value;
 * random flags (chains, writable) and links (loops); random available indexes and
 * heads. Every queue is notified, and one random register (0x000-0x1fc, the
 * configuration space included) gets a random value. Interrupts are never taken (the
 * 8259s are masked) nor acknowledged, and used buffers never taken back. At the end
 * every device is reset (so its worker ends) and "tiny: hostile virtio done" printed.
 *
 * Devices write only from HOSTILE_SCRATCH up, so the guest's own code and data stay
 * intact: no indirect tables (their addresses would come from bytes a device wrote),
 * and no random values for the ring address registers (0x80-0xbf; such writes go to
 * the configuration space instead), else a device could be told to write over the
 * guest's code. The pages from HOSTILE_SCRATCH to the end of memory are touched first
 * ("tiny: hostile virtio start"), so the VMM's RSS does not grow with them after that;
 * the devices are left alone for 2 s after that line, for the host's measures.
 */
hostile_virtio:
    pushq %rbx
    pushq %r12
    pushq %r13
    /* The devices' interrupts stay pending: both 8259s masked (unmasked they would
     * arrive through LINT0 at vectors the guest does not handle). */
    movb $0xff, %al
    outb %al, $0x21
    outb %al, $0xa1
    movq $HOSTILE_SCRATCH, %rdi
1:  movq $0, (%rdi)
    addq $4096, %rdi
    cmpq $HOSTILE_RAM_END, %rdi
    jb   1b
    leaq msg_hv_start(%rip), %rdi
    call lock_serial
    call puts
    call unlock_serial
    movq ticks(%rip), %rax          /* 2 s for the host to take its measures */
    addq $2000, %rax
1:  hlt
    cmpq %rax, ticks(%rip)
    jb   1b
    rdtsc
    shlq $32, %rdx
    orq  %rdx, %rax
    leaq 1(%rax), %r8               /* r8: generator state, never 0 */
    movq opt_hostile_virtio(%rip), %r9
hv_round:
    movl $VIRTIO_MMIO, %ebx         /* rbx: the device's registers */
hv_device:
    cmpl $VIRTIO_MAGIC, (%rbx)
    jne  hv_next_device
    movl $0, 0x70(%rbx)             /* status: reset */
    movl $1, 0x70(%rbx)             /* ACKNOWLEDGE */
    movl $3, 0x70(%rbx)             /* DRIVER */
    movl $0, 0x24(%rbx)
    call xorshift
    movl %eax, 0x20(%rbx)           /* driver features 0-31: random */
    movl $1, 0x24(%rbx)
    shrq $32, %rax
    orl  $1, %eax                   /* 32-63: random, VERSION_1 set */
    movl %eax, 0x20(%rbx)
    movl $0xb, 0x70(%rbx)           /* FEATURES_OK */
    xorl %r11d, %r11d               /* r11: queue */
hv_queue:
    movl %r11d, 0x30(%rbx)          /* QueueSel */
    call xorshift
    movl %eax, %ecx
    andl $7, %ecx
    cmpl $7, %ecx
    jne  1f
    shrl $8, %eax                   /* one in eight: a random size */
    jmp  2f
1:  movl $1, %eax
    shll %cl, %eax                  /* 1 to 128 */
    testl $0x100, %r8d
    jz   2f
    shll $1, %eax                   /* or 2 to 256 */
2:  movl %eax, 0x38(%rbx)           /* QueueNum */
    movl %r11d, %edx
    shll $14, %edx
    addl $HOSTILE_SCRATCH, %edx     /* rings at scratch + 16 KiB * queue */
    call xorshift
    testl $0x7000, %eax
    jnz  3f
    movl %eax, %edx
    orl  $0x80000000, %edx          /* one in eight: above 2 GiB, outside memory */
3:  movl %edx, 0x80(%rbx)           /* descriptor table */
    movl $0, 0x84(%rbx)
    leal 0x1000(%rdx), %eax
    movl %eax, 0x90(%rbx)           /* available ring */
    movl $0, 0x94(%rbx)
    leal 0x2000(%rdx), %eax
    movl %eax, 0xa0(%rbx)           /* used ring */
    movl $0, 0xa4(%rbx)
    movl $1, 0x44(%rbx)             /* QueueReady */
    incl %r11d
    cmpl $3, %r11d
    jb   hv_queue
    movl $0xf, 0x70(%rbx)           /* DRIVER_OK */
    movl $16, %r12d
hv_burst:
    call hv_scramble
    movl $0, 0x50(%rbx)             /* QueueNotify 0, 1, 2 */
    movl $1, 0x50(%rbx)
    movl $2, 0x50(%rbx)
    call xorshift
    movl %eax, %ecx
    andl $0x1fc, %ecx
    movl %ecx, %edx
    andl $0x1c0, %edx
    cmpl $0x80, %edx
    jne  1f
    orl  $0x100, %ecx               /* not the ring addresses (0x80-0xbf): config space */
1:  shrq $32, %rax
    movl %eax, (%rbx,%rcx)          /* one register: a random value */
    decl %r12d
    jnz  hv_burst
hv_next_device:
    addl $0x1000, %ebx
    cmpl $(VIRTIO_MMIO + VIRTIO_SLOTS * 0x1000), %ebx
    jb   hv_device
    decq %r9
    jnz  hv_round
    movl $VIRTIO_MMIO, %ebx         /* at last, every device reset: workers end */
1:  movl $0, 0x70(%rbx)
    addl $0x1000, %ebx
    cmpl $(VIRTIO_MMIO + VIRTIO_SLOTS * 0x1000), %ebx
    jb   1b
    leaq msg_hv_done(%rip), %rdi
    call lock_serial
    call puts
    call unlock_serial
    popq %r13
    popq %r12
    popq %rbx
    ret

/* Random descriptor tables and available rings for queues 0-2 (hostile_virtio). */
hv_scramble:
    movq $HOSTILE_SCRATCH, %rsi     /* rsi: this queue's descriptor table */
1:  xorl %ecx, %ecx                 /* descriptor */
2:  call xorshift
    movq %rax, %rdx
    andl $0xffff, %edx
    movl %eax, %r10d
    shrl $16, %r10d
    andl $7, %r10d
    cmpl $1, %r10d
    je   3f
    cmpl $2, %r10d
    je   4f
    addq $HOSTILE_SCRATCH, %rdx     /* in the scratch area */
    jmp  5f
3:  addq $(HOSTILE_RAM_END - 0x8000), %rdx /* running past the end of memory */
    jmp  5f
4:  btsq $40, %rdx                  /* beyond 1 TiB */
5:  movq %rdx, (%rsi,%rcx,8)
    shrq $32, %rax                  /* length, flags, next from the high half */
    testl $0x100000, %eax
    jz   6f
    andl $0x3ff, %eax               /* half of them short */
6:  movl %eax, 8(%rsi,%rcx,8)
    call xorshift
    andl $0xff0003, %eax            /* flags NEXT and WRITE at random, next 0-255 */
    movl %eax, 12(%rsi,%rcx,8)
    addl $2, %ecx                   /* 16 bytes a descriptor: two quadwords */
    cmpl $512, %ecx
    jb   2b
    /* the available ring: flags, index and 256 heads, all random */
    leaq 0x1000(%rsi), %rdi
    movl $66, %ecx
7:  call xorshift
    movq %rax, (%rdi)
    addq $8, %rdi
    decl %ecx
    jnz  7b
    addq $0x4000, %rsi
    cmpq $(HOSTILE_SCRATCH + 3 * 0x4000), %rsi
    jb   1b
    ret
