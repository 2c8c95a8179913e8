// Package qmp is a small QEMU Machine Protocol client (QEMU's
// docs/interop/qmp-spec.rst): JSON commands over QEMU's -qmp socket, one
// at a time, with events kept for WaitEvent, and the hot-plug of an
// ivshmem-plain device (docs/vm.md, "Pair regions"), which hostd uses to
// plug a VM pair's region into both VMs and the VM tests use for live
// migration.
//
//	hostd                      QEMU (-qmp unix:PATH,server=on,wait=off)
//	  Dial  ------------------> greeting, qmp_capabilities
//	  Plug  ------------------> object-add memory-backend-file share=on
//	                            device_add ivshmem-plain       (guest: ACPI or PCIe hotplug)
//	  Unplug -----------------> device_del ... DEVICE_DELETED  (guest ejects)
//	                            object-del (retried while "in use")
//
// QEMU serves one QMP client per socket at a time: a second client's
// greeting waits until the first one closes.
package qmp
