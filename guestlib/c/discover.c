/* VM discovery through sysfs: the control ports, the group region's BAR
 * and the BARs of pair regions plugged later.
 * The rules are docs/vm.md, "Discovery", which the Go library applies
 * too (vhost/vserial.FindAll and Open, vhost/ivshmem.Find); a change to
 * them changes both. */
#define _GNU_SOURCE
#include "internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>

#define PORT_NAME    "org.shunt.ctl"
#define PORTS_SYSFS  "/sys/class/virtio-ports"
#define PORTS_UDEV   "/dev/virtio-ports"
#define PCI_SYSFS    "/sys/bus/pci/devices"
#define SMALL_FILE   64 /* sysfs attributes read here (names, ids) are shorter */

/* read_small reads a small sysfs file into buf (NUL-terminated, without
 * its newline). */
static int read_small(const char *path, char *buf, size_t n)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t k = sys_read(fd, buf, n - 1);
	sys_close(fd);
	if (k <= 0)
		return -1;
	buf[k] = 0;
	buf[strcspn(buf, "\n")] = 0;
	return 0;
}

/* join writes dir/name to out: 0, or -1 if it does not fit in n bytes
 * (then the name is not one of ours, which are short). */
static int join(char *out, size_t n, const char *dir, const char *name)
{
	size_t a = strlen(dir), b = strlen(name);
	if (a + 1 + b >= n)
		return -1;
	memcpy(out, dir, a);
	out[a] = '/';
	memcpy(out + a + 1, name, b + 1);
	return 0;
}

/* port_index is vserial.IndexOf: 0 for org.shunt.ctl, N for
 * org.shunt.ctl.N (N >= 1, no leading zero), -1 for other names. */
static long port_index(const char *name)
{
	size_t k = strlen(PORT_NAME);
	if (strncmp(name, PORT_NAME, k))
		return -1;
	if (!name[k])
		return 0;
	if (name[k] != '.' || name[k + 1] < '1' || name[k + 1] > '9')
		return -1;
	char *end;
	long i = strtol(name + k + 1, &end, 10);
	return *end || i > INT32_MAX ? -1 : i;
}

struct found { long idx; char *path; };

static int by_index(const void *a, const void *b)
{
	long x = ((const struct found *)a)->idx, y = ((const struct found *)b)->idx;
	return (x > y) - (x < y);
}

/* add records path for port idx; a udev link replaces a /dev/vportNpM. */
static int add(struct found **v, size_t *n, size_t *cap, long idx, const char *path, int link)
{
	for (size_t i = 0; i < *n; i++)
		if ((*v)[i].idx == idx) {
			if (!link)
				return 0;
			char *p = strdup(path);
			if (!p)
				return -1;
			free((*v)[i].path);
			(*v)[i].path = p;
			return 0;
		}
	if (*n == *cap) {
		size_t c = *cap ? 2 * *cap : 8;
		struct found *more = realloc(*v, c * sizeof *more);
		if (!more)
			return -1;
		*v = more;
		*cap = c;
	}
	if (!((*v)[*n].path = strdup(path)))
		return -1;
	(*v)[(*n)++].idx = idx;
	return 0;
}

char **shunt_find_ports(void)
{
	struct found *v = NULL;
	size_t n = 0, cap = 0;
	int bad = 0;
	char p[SHUNT_PATH_MAX], name[SMALL_FILE];
	/* By name under sysfs: the devices, for guests without udev. */
	DIR *dir = opendir(PORTS_SYSFS);
	for (struct dirent *e; dir && !bad && (e = readdir(dir));) {
		long idx;
		char port[SHUNT_PATH_MAX];
		if (e->d_name[0] == '.' || join(port, sizeof port, PORTS_SYSFS, e->d_name) ||
		    join(p, sizeof p, port, "name") || read_small(p, name, sizeof name) < 0 ||
		    (idx = port_index(name)) < 0 || join(p, sizeof p, "/dev", e->d_name))
			continue;
		bad = add(&v, &n, &cap, idx, p, 0);
	}
	if (dir)
		closedir(dir);
	/* The udev links, preferred (and enough where sysfs is not mounted). */
	dir = opendir(PORTS_UDEV);
	for (struct dirent *e; dir && !bad && (e = readdir(dir));) {
		long idx = port_index(e->d_name);
		struct stat st;
		if (idx >= 0 && join(p, sizeof p, PORTS_UDEV, e->d_name) == 0 && stat(p, &st) == 0)
			bad = add(&v, &n, &cap, idx, p, 1);
	}
	if (dir)
		closedir(dir);
	char **out = bad ? NULL : calloc(n + 1, sizeof *out);
	if (out) {
		qsort(v, n, sizeof *v, by_index);
		for (size_t i = 0; i < n; i++)
			out[i] = v[i].path;
	} else {
		for (size_t i = 0; i < n; i++)
			free(v[i].path);
	}
	free(v);
	return out;
}

void shunt_free_ports(char **ports)
{
	for (char **p = ports; p && *p; p++)
		free(*p);
	free(ports);
}

/* pci_attr builds the path of a PCI device's sysfs attribute: 0, or -1 if
 * it does not fit (then the device is not ours: its name would be longer
 * than any PCI address). */
static int pci_attr(char *out, size_t n, const char *dev, const char *attr)
{
	char d[SHUNT_PATH_MAX];
	return join(d, sizeof d, PCI_SYSFS, dev) || join(out, n, d, attr) ? -1 : 0;
}

/* is_ivshmem reports whether PCI device dev is an ivshmem device
 * (1af4:1110). */
static int is_ivshmem(const char *dev)
{
	char p[SHUNT_PATH_MAX], v[SMALL_FILE];
	return !pci_attr(p, sizeof p, dev, "vendor") && read_small(p, v, sizeof v) == 0 && !strcmp(v, "0x1af4") &&
	       !pci_attr(p, sizeof p, dev, "device") && read_small(p, v, sizeof v) == 0 && !strcmp(v, "0x1110");
}

/* pci_enable enables dev unless it is already (each write of "1" counts
 * one more enable, and needs root). If this fails, mapping the BAR will
 * say so. */
static void pci_enable(const char *dev)
{
	char p[SHUNT_PATH_MAX], en[SMALL_FILE];
	if (pci_attr(p, sizeof p, dev, "enable") == 0 && (read_small(p, en, sizeof en) < 0 || strcmp(en, "1"))) {
		int fd = open(p, O_WRONLY | O_CLOEXEC);
		if (fd >= 0) {
			(void)sys_write(fd, "1", 1);
			sys_close(fd);
		}
	}
}

int shunt_find_bar(char *out, size_t n)
{
	/* The first ivshmem device in address order (PCI addresses have a
	 * fixed width, so in strcmp order), as Go's sorted glob finds it. */
	char best[SMALL_FILE] = "";
	DIR *dir = opendir(PCI_SYSFS);
	for (struct dirent *e; dir && (e = readdir(dir));) {
		if (e->d_name[0] == '.' || strlen(e->d_name) >= sizeof best || (best[0] && strcmp(e->d_name, best) >= 0))
			continue;
		if (is_ivshmem(e->d_name))
			strcpy(best, e->d_name);
	}
	if (dir)
		closedir(dir);
	if (!best[0])
		return -1;
	pci_enable(best);
	return pci_attr(out, n, best, "resource2");
}

/* The region header's name of a pair region (docs/region.md: region id,
 * guest A, guest B), which hostd writes before it plugs the device. */
#define HDR_REGION_ID 72
#define HDR_GUEST_A   76
#define HDR_GUEST_B   80

int shunt_open_pair_bar(uint32_t id, uint32_t gid, uint64_t size)
{
	int found = -1;
	DIR *dir = opendir(PCI_SYSFS);
	for (struct dirent *e; dir && found < 0 && (e = readdir(dir));) {
		char p[SHUNT_PATH_MAX];
		struct stat st;
		if (e->d_name[0] == '.' || !is_ivshmem(e->d_name) || pci_attr(p, sizeof p, e->d_name, "resource2"))
			continue;
		pci_enable(e->d_name);
		int fd = open(p, O_RDWR | O_CLOEXEC);
		if (fd < 0)
			continue;
		if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != size || size < 4096) {
			sys_close(fd);
			continue;
		}
		/* The header through a mapping of its first page: a BAR's sysfs
		 * file can be mapped, not read. */
		const uint8_t *h = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
		if (h == MAP_FAILED) {
			sys_close(fd);
			continue;
		}
		uint32_t rid, a, b;
		memcpy(&rid, h + HDR_REGION_ID, 4);
		memcpy(&a, h + HDR_GUEST_A, 4);
		memcpy(&b, h + HDR_GUEST_B, 4);
		munmap((void *)h, 4096);
		if (rid == id && (a == gid || b == gid))
			found = fd;
		else
			sys_close(fd);
	}
	if (dir)
		closedir(dir);
	return found;
}

void shunt_pci_rescan(void)
{
	int fd = open("/sys/bus/pci/rescan", O_WRONLY | O_CLOEXEC);
	if (fd >= 0) {
		(void)sys_write(fd, "1", 1);
		sys_close(fd);
	}
}
