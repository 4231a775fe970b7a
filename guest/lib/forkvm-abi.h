/*
 * forkvm's guest ports (docs/guest-abi.md, docs/invoke.md): the numbers the guest
 * tools (guest/tools) and libforkvm share. Constants only.
 */
#ifndef FORKVM_ABI_H
#define FORKVM_ABI_H

#define PROBE_PORT 0xf40
#define PROBE_MAGIC 0x4d564b46u /* "FKVM" */
#define CLONE_PORT 0xf48
#define DONE_PORT 0xf4c
#define ENTROPY_PORT 0xf50
#define IDENTITY_PORT 0xf54
#define CLOCK_PORT 0xf58
#define IDENTITY_BLOCK 0xf60
#define IDENTITY_BLOCK_LEN 32
#define INVOKE_PORT 0xf80
#define MAILBOX_ADDR_PORT 0xf84
#define MAILBOX_SIZE_PORT 0xf88
#define INVOKE_VERSION_PORT 0xf8c
#define CRNG_PORT 0xf90 /* reads 1 once the kernel's CRNG is registered for rekeying */

#endif
