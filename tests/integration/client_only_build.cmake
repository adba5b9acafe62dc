# test_client_only_build: `cmake -DKVD_DAEMON=OFF` configures, builds and
# installs libkvd, kvctl and the headers while pkg-config finds nothing (so
# no libevent, inih, libsystemd or CMocka), installs no daemon, and the
# installed library is usable from another project through its CMake
# package and through pkg-config.
# cmake -DSRC=<kvd source> -DWORK=<scratch dir> -DVERSION=<x.y.z> -P client_only_build.cmake
cmake_minimum_required(VERSION 3.24)
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/no-pkgconfig")
set(prefix "${WORK}/prefix")

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

# Nothing reachable through pkg-config: a daemon dependency would fail here.
set(ENV{PKG_CONFIG_LIBDIR} "${WORK}/no-pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
run("configure -DKVD_DAEMON=OFF" ${CMAKE_COMMAND} -S "${SRC}" -B "${WORK}/build" -DKVD_DAEMON=OFF
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_INSTALL_PREFIX=${prefix}")
run("build" ${CMAKE_COMMAND} --build "${WORK}/build" -j2)
run("install" ${CMAKE_COMMAND} --install "${WORK}/build")
foreach(f bin/kvctl include/kvd/client.h include/kvd/version.h include/kvd/status.h
        include/kvd/protocol.h)
  if(NOT EXISTS "${prefix}/${f}")
    message(FATAL_ERROR "not installed: ${f}")
  endif()
endforeach()
file(GLOB_RECURSE pc "${prefix}/*/libkvd.pc")
file(GLOB_RECURSE config "${prefix}/*/kvdConfig.cmake")
file(GLOB_RECURSE daemon "${prefix}/*/kvd" "${prefix}/*/kvd.service" "${prefix}/*/version.h.in")
if(NOT pc OR NOT config)
  message(FATAL_ERROR "libkvd.pc (${pc}) or kvdConfig.cmake (${config}) not installed")
endif()
list(FILTER daemon EXCLUDE REGEX "/include/kvd$|/doc/kvd$")
if(daemon)
  message(FATAL_ERROR "a client-only install holds ${daemon}")
endif()
run("kvctl --version" "${prefix}/bin/kvctl" --version)
if(NOT out MATCHES "^kvctl ${VERSION} \\(protocol 1, libkvd ${VERSION}\\)")
  message(FATAL_ERROR "kvctl --version: ${out}")
endif()

# Another project, through the CMake package.
run("consumer configure" ${CMAKE_COMMAND} -S "${SRC}/tests/integration/consumer"
    -B "${WORK}/consumer" "-DCMAKE_PREFIX_PATH=${prefix}" "-DKVD_EXPECT_VERSION=${VERSION}")
run("consumer build" ${CMAKE_COMMAND} --build "${WORK}/consumer")
run("consumer run" "${WORK}/consumer/consumer")

# The same program through pkg-config.
get_filename_component(pcdir "${pc}" DIRECTORY)
set(ENV{PKG_CONFIG_LIBDIR} "${pcdir}")
run("pkg-config" pkg-config --modversion libkvd)
string(STRIP "${out}" pcver)
if(NOT pcver STREQUAL VERSION)
  message(FATAL_ERROR "libkvd.pc says ${pcver}, the project ${VERSION}")
endif()
run("pkg-config" pkg-config --cflags --libs libkvd)
separate_arguments(flags UNIX_COMMAND "${out}")
get_filename_component(libdir "${pcdir}" DIRECTORY)
run("cc with pkg-config" cc -std=c11 -Wall -Werror "-DKVD_EXPECT_VERSION=\"${VERSION}\""
    "${SRC}/tests/integration/consumer/consumer.c" ${flags} "-Wl,-rpath,${libdir}"
    -o "${WORK}/consumer-pc")
run("consumer (pkg-config) run" "${WORK}/consumer-pc")
file(REMOVE_RECURSE "${WORK}")
