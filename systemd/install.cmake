# Installs the systemd units and the configuration at `cmake --install` time,
# so the paths in the unit follow the prefix given there (--prefix /usr:
# /usr/sbin/kvd, /etc/kvd/kvd.conf, /usr/share/doc/kvd), as GNUInstallDirs
# would place them. The default kvd.conf is installed only when none is
# there: a reinstall never overwrites an administrator's settings.
# Set by the caller (install(CODE)): KVD_SOURCE_DIR, KVD_BINARY_DIR,
# KVD_SBINDIR, KVD_SYSCONFDIR, KVD_DOCDIR (relative, or absolute).

set(prefix "${CMAKE_INSTALL_PREFIX}")
function(kvd_install_dir out rel)
  if(IS_ABSOLUTE "${rel}")
    set(${out} "${rel}" PARENT_SCOPE)
  else()
    set(${out} "${prefix}/${rel}" PARENT_SCOPE)
  endif()
endfunction()
kvd_install_dir(sbindir "${KVD_SBINDIR}")
kvd_install_dir(docdir "${KVD_DOCDIR}")
if(IS_ABSOLUTE "${KVD_SYSCONFDIR}")
  set(sysconfdir "${KVD_SYSCONFDIR}")
elseif(prefix STREQUAL "/usr" OR prefix STREQUAL "/")
  set(sysconfdir "/etc") # GNUInstallDirs' rule for the system prefixes
else()
  set(sysconfdir "${prefix}/${KVD_SYSCONFDIR}")
endif()

file(READ "${KVD_SOURCE_DIR}/systemd/kvd.service" unit)
string(REPLACE "/usr/sbin/kvd" "${sbindir}/kvd" unit "${unit}")
string(REPLACE "/etc/kvd/" "${sysconfdir}/kvd/" unit "${unit}")
string(REPLACE "file:///usr/share/doc/kvd/" "file://${docdir}/" unit "${unit}")
file(MAKE_DIRECTORY "${KVD_BINARY_DIR}/systemd")
file(WRITE "${KVD_BINARY_DIR}/systemd/kvd.service" "${unit}")
file(INSTALL "${KVD_BINARY_DIR}/systemd/kvd.service" "${KVD_SOURCE_DIR}/systemd/kvd.socket"
     DESTINATION "${prefix}/lib/systemd/system")
file(INSTALL "${KVD_SOURCE_DIR}/systemd/kvd.conf.example" DESTINATION "${sysconfdir}/kvd")
if(EXISTS "$ENV{DESTDIR}${sysconfdir}/kvd/kvd.conf")
  message(STATUS "Keeping: $ENV{DESTDIR}${sysconfdir}/kvd/kvd.conf")
else()
  file(INSTALL "${KVD_SOURCE_DIR}/systemd/kvd.conf" DESTINATION "${sysconfdir}/kvd")
endif()
