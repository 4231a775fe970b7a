/*
 * forkvm-oci: runs a container's process in this VM, on a root file system in a disk
 * slot (docs/guest-abi.md; the work is in forkvm-oci.h, which forkvm-agent shares).
 */
#include "forkvm-oci.h"

int main(int argc, char **argv)
{
    return oci_main(argc, argv);
}
