/* ckptd_enter_mntns.so: LD_PRELOAD'ed into CRIU by ckptd to run it inside a container's mount
 * namespace while loading it (and its libraries) from the node's: the dynamic loader maps
 * everything from the node's file system, then this constructor, before CRIU's main(),
 * enters the mount namespace open at descriptor $CKPTD_ENTER_MNTNS_FD (setns also moves the
 * root and working directory to that namespace's root: the container's root filesystem).
 * The variables are removed so that what CRIU executes does not inherit them.
 * A failure exits 127 with one line on stderr: CRIU never runs in the wrong namespace. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

__attribute__((constructor)) static void ckptd_enter_mntns(void)
{
	const char *value = getenv("CKPTD_ENTER_MNTNS_FD");
	char *end;
	long fd;

	if (value == NULL)
		return;
	errno = 0;
	fd = strtol(value, &end, 10);
	if (errno || *value == '\0' || *end != '\0' || fd < 0 || fd > 65535) {
		fprintf(stderr, "ckptd_enter_mntns: bad CKPTD_ENTER_MNTNS_FD=%s\n", value);
		_exit(127);
	}
	if (setns((int)fd, CLONE_NEWNS) != 0) {
		fprintf(stderr, "ckptd_enter_mntns: setns(%ld, CLONE_NEWNS): %s\n", fd,
			strerror(errno));
		_exit(127);
	}
	close((int)fd);
	unsetenv("CKPTD_ENTER_MNTNS_FD");
	unsetenv("LD_PRELOAD");
}
